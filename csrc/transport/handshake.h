// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace torch_rpc_ext::transport {

// The connection handshake (docs/wire-format.md, "Handshake"). Mutual
// challenge-response over HMAC-SHA256 with fresh 32-byte nonces from both
// ends, so neither a proof nor a recorded session can be replayed:
//
//   client -> server  kHello     {clientId, clientNonce}
//   server -> client  kChallenge {serverId, serverNonce, serverProof}
//   client -> server  kProof     {clientProof}
//
//   proof(role) = HMAC(secret, "torch_rpc_ext/1/" role || clientNonce ||
//                      serverNonce || clientId || serverId)
//
// Nothing but these three fixed-size heads is parsed before the proof of the
// peer checks out.
constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kHelloBytes = 4 + kNonceBytes;
constexpr size_t kChallengeBytes = 4 + kNonceBytes + kProofBytes;

struct Hello {
  int32_t clientId;
  std::string clientNonce;
};

struct Challenge {
  int32_t serverId;
  std::string serverNonce;
  std::string serverProof;
};

std::string encodeHello(const Hello& h);
std::optional<Hello> decodeHello(const std::string& head);
std::string encodeChallenge(const Challenge& c);
std::optional<Challenge> decodeChallenge(const std::string& head);

// The proof `role` ("client" or "server") sends for this session.
std::string makeProof(
    const std::string& secret,
    const char* role,
    const std::string& clientNonce,
    const std::string& serverNonce,
    int32_t clientId,
    int32_t serverId);

// Constant-time comparison of a received proof with the expected one.
bool proofMatches(const std::string& received, const std::string& expected);

} // namespace torch_rpc_ext::transport
