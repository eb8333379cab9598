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

void putInc(std::string& out, uint64_t inc) {
  char b[8];
  std::memcpy(b, &inc, 8);
  out.append(b, 8);
}

uint64_t getInc(const std::string& in, size_t at) {
  uint64_t inc;
  std::memcpy(&inc, in.data() + at, 8);
  return inc;
}

} // namespace

std::string encodeHello(const Hello& h) {
  std::string out;
  putId(out, h.clientId);
  putInc(out, h.clientInc);
  out += h.clientNonce;
  return out;
}

std::optional<Hello> decodeHello(const std::string& head) {
  if (head.size() != kHelloBytes) {
    return std::nullopt;
  }
  return Hello{getId(head, 0), getInc(head, 4), head.substr(12, kNonceBytes)};
}

std::string encodeChallenge(const Challenge& c) {
  std::string out;
  putId(out, c.serverId);
  putInc(out, c.serverInc);
  out += c.serverNonce;
  return out;
}

std::optional<Challenge> decodeChallenge(const std::string& head) {
  if (head.size() != kChallengeBytes) {
    return std::nullopt;
  }
  return Challenge{
      getId(head, 0), getInc(head, 4), head.substr(12, kNonceBytes)};
}

std::string makeProof(
    const std::string& secret,
    const char* role,
    const std::string& clientNonce,
    const std::string& serverNonce,
    int32_t clientId,
    int32_t serverId,
    uint64_t clientInc,
    uint64_t serverInc,
    const std::string& binding) {
  std::string msg = std::string("torch_rpc_ext/3/") + role;
  msg += clientNonce;
  msg += serverNonce;
  putId(msg, clientId);
  putId(msg, serverId);
  putInc(msg, clientInc);
  putInc(msg, serverInc);
  msg += binding;
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

Handshake::Handshake(
    bool client,
    std::string secret,
    int32_t selfId,
    int32_t expectedPeerId,
    int32_t peerIdLimit,
    uint64_t selfInc,
    AdmitFn admit)
    : client_(client),
      secret_(std::move(secret)),
      selfId_(selfId),
      expectedPeerId_(expectedPeerId),
      peerIdLimit_(peerIdLimit),
      selfInc_(selfInc),
      admit_(std::move(admit)),
      stage_(client ? Stage::kChallenge : Stage::kHello) {}

std::string Handshake::hello() {
  clientNonce_ = randomBytes(kNonceBytes);
  return encodeHello(Hello{selfId_, selfInc_, clientNonce_});
}

frame::FrameKind Handshake::expectedKind() const {
  switch (stage_) {
    case Stage::kHello:
      return frame::FrameKind::kHello;
    case Stage::kChallenge:
      return frame::FrameKind::kChallenge;
    default:
      return frame::FrameKind::kProof;
  }
}

size_t Handshake::expectedHeadBytes() const {
  switch (stage_) {
    case Stage::kHello:
      return kHelloBytes;
    case Stage::kChallenge:
      return kChallengeBytes;
    default:
      return kProofBytes;
  }
}

Handshake::Step Handshake::onFrame(const std::string& head) {
  Step step;
  // On TLS the proofs also cover the session (binding_): a relay between
  // two sessions fails them as a stranger would.
  const std::string kBadSecret = binding_.empty()
      ? "authentication failed: peer does not know the group secret"
      : "authentication failed: peer does not know the group secret, or its "
        "proof was made for another TLS session (a relay between us)";
  auto proofOf = [&](const char* role) {
    return client_ ? makeProof(
                         secret_,
                         role,
                         clientNonce_,
                         serverNonce_,
                         selfId_,
                         peerId_,
                         selfInc_,
                         peerInc_,
                         binding_)
                   : makeProof(
                         secret_,
                         role,
                         clientNonce_,
                         serverNonce_,
                         peerId_,
                         selfId_,
                         peerInc_,
                         selfInc_,
                         binding_);
  };
  // The peer's proof checks out: may it stay?
  auto admitted = [&]() {
    if (admit_) {
      std::string why = admit_(peerId_, peerInc_);
      if (!why.empty()) {
        step.error = "rejected handshake: " + why;
        return false;
      }
    }
    return true;
  };
  if (stage_ == Stage::kHello) {
    auto hello = decodeHello(head);
    if (!hello || hello->clientId < 0) {
      step.error = "rejected handshake: malformed hello";
      return step;
    }
    if (peerIdLimit_ > 0 && hello->clientId >= peerIdLimit_) {
      // Ids index the agent's per-peer tables: never let one past them.
      step.error = "rejected handshake: worker id " +
          std::to_string(hello->clientId) + " is not in this group of " +
          std::to_string(peerIdLimit_) + " workers";
      return step;
    }
    // Trusted only once the client's proof checks out; until then the
    // client gets a nonce and nothing computed from the secret.
    peerId_ = hello->clientId;
    peerInc_ = hello->clientInc;
    clientNonce_ = hello->clientNonce;
    serverNonce_ = randomBytes(kNonceBytes);
    step.hasReply = true;
    step.replyKind = frame::FrameKind::kChallenge;
    step.replyHead =
        encodeChallenge(Challenge{selfId_, selfInc_, serverNonce_});
    stage_ = Stage::kProof;
    return step;
  }
  if (stage_ == Stage::kChallenge) {
    auto ch = decodeChallenge(head);
    if (!ch) {
      step.error = "rejected handshake: malformed challenge";
      return step;
    }
    if (ch->serverId != expectedPeerId_) {
      step.error = "rejected handshake: expected worker id " +
          std::to_string(expectedPeerId_) + " but the peer is worker id " +
          std::to_string(ch->serverId);
      return step;
    }
    peerId_ = ch->serverId;
    peerInc_ = ch->serverInc;
    serverNonce_ = ch->serverNonce;
    step.hasReply = true;
    step.replyKind = frame::FrameKind::kProof;
    step.replyHead = proofOf("client");
    stage_ = Stage::kServerProof;
    return step;
  }
  if (stage_ == Stage::kProof) {
    // The server: the client proves first.
    if (!proofMatches(head, proofOf("client"))) {
      peerId_ = -1;
      step.error = kBadSecret;
      step.proofRefused = true;
      return step;
    }
    if (!admitted()) {
      peerId_ = -1;
      return step;
    }
    step.hasReply = true;
    step.replyKind = frame::FrameKind::kProof;
    step.replyHead = proofOf("server");
    stage_ = Stage::kDone;
    step.done = true;
    return step;
  }
  if (stage_ == Stage::kServerProof) {
    if (!proofMatches(head, proofOf("server"))) {
      peerId_ = -1;
      step.error = kBadSecret;
      return step;
    }
    if (!admitted()) {
      peerId_ = -1;
      return step;
    }
    stage_ = Stage::kDone;
    step.done = true;
    return step;
  }
  step.error = "rejected handshake: unexpected frame";
  return step;
}

} // namespace torch_rpc_ext::transport
