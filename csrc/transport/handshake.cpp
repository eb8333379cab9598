// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/handshake.h"

#include <cstring>

#include "csrc/common/crypto.h"

namespace torch_rpc_ext::transport {

namespace {

void putId(std::string& out, int32_t id) {
  char b[4];
  std::memcpy(b, &id, 4);
  out.append(b, 4);
}

int32_t getId(const std::string& in, size_t at) {
  int32_t id;
  std::memcpy(&id, in.data() + at, 4);
  return id;
}

} // namespace

std::string encodeHello(const Hello& h) {
  std::string out;
  putId(out, h.clientId);
  out += h.clientNonce;
  return out;
}

std::optional<Hello> decodeHello(const std::string& head) {
  if (head.size() != kHelloBytes) {
    return std::nullopt;
  }
  return Hello{getId(head, 0), head.substr(4, kNonceBytes)};
}

std::string encodeChallenge(const Challenge& c) {
  std::string out;
  putId(out, c.serverId);
  out += c.serverNonce;
  out += c.serverProof;
  return out;
}

std::optional<Challenge> decodeChallenge(const std::string& head) {
  if (head.size() != kChallengeBytes) {
    return std::nullopt;
  }
  return Challenge{
      getId(head, 0),
      head.substr(4, kNonceBytes),
      head.substr(4 + kNonceBytes, kProofBytes)};
}

std::string makeProof(
    const std::string& secret,
    const char* role,
    const std::string& clientNonce,
    const std::string& serverNonce,
    int32_t clientId,
    int32_t serverId) {
  std::string msg = std::string("torch_rpc_ext/1/") + role;
  msg += clientNonce;
  msg += serverNonce;
  putId(msg, clientId);
  putId(msg, serverId);
  Digest d = hmacSha256(secret, msg);
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

bool proofMatches(const std::string& received, const std::string& expected) {
  if (received.size() != kProofBytes || expected.size() != kProofBytes) {
    return false;
  }
  Digest a, b;
  std::memcpy(a.data(), received.data(), kProofBytes);
  std::memcpy(b.data(), expected.data(), kProofBytes);
  return constantTimeEqual(a, b);
}

} // namespace torch_rpc_ext::transport
