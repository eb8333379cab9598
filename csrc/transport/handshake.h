// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "csrc/frame/frame.h"

namespace torch_rpc_ext::transport {

// The connection handshake (docs/wire-format.md, "Handshake"). Mutual
// challenge-response over HMAC-SHA256 with fresh 32-byte nonces from both
// ends, so neither a proof nor a recorded session can be replayed:
//
//   client -> server  kHello     {clientId, clientInc, clientNonce}
//   server -> client  kChallenge {serverId, serverInc, serverNonce}
//   client -> server  kProof     {clientProof}
//   server -> client  kProof     {serverProof}
//
//   proof(role) = HMAC(secret, "torch_rpc_ext/3/" role || clientNonce ||
//                      serverNonce || clientId || serverId || clientInc ||
//                      serverInc [|| binding])
//
// binding: on a TLS connection, the session's exporter value
// (TlsSession::exporter), so both proofs hold for this TLS session only: a
// relay that terminates TLS with each end (mutual TLS with any certificate
// from the CA) cannot pass them on. Empty, and left out, in the clear.
//
// An incarnation is the 64-bit id of one holder of a worker id in a dynamic
// group (docs/elastic.md), 0 in a static group: both ends prove theirs, so a
// process that held an id before cannot pass for its current holder.
// The client proves first: the server, which anyone who reaches its port
// can talk to, sends nothing computed from the secret until the client has
// proved it (no oracle for guessing the secret offline); the client sends
// no message until the server has proved it in turn. Nothing but these
// fixed-size heads is parsed before the proof of the peer checks out.
constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
constexpr size_t kHelloBytes = 4 + 8 + kNonceBytes;
constexpr size_t kChallengeBytes = 4 + 8 + kNonceBytes;

struct Hello {
  int32_t clientId;
  uint64_t clientInc;
  std::string clientNonce;
};

struct Challenge {
  int32_t serverId;
  uint64_t serverInc;
  std::string serverNonce;
};

// Whether an authenticated peer (its id and incarnation) may stay: "" if so,
// else why not. Asked once per connection, after the peer's proof.
using AdmitFn = std::function<std::string(int32_t id, uint64_t incarnation)>;

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
    int32_t serverId,
    uint64_t clientInc,
    uint64_t serverInc,
    const std::string& binding = "");

// Constant-time comparison of a received proof with the expected one.
bool proofMatches(const std::string& received, const std::string& expected);

// One end of the handshake as a state machine, independent of how bytes
// move, so every transport runs the same protocol. Not thread-safe: a
// connection drives it from its loop thread.
class Handshake {
 public:
  Handshake(
      bool client,
      std::string secret,
      int32_t selfId,
      int32_t expectedPeerId,
      int32_t peerIdLimit = 0,
      uint64_t selfInc = 0,
      AdmitFn admit = nullptr);

  // What to do after a frame: close with `error`, and/or send `reply`.
  struct Step {
    std::string error;
    bool hasReply = false;
    frame::FrameKind replyKind = frame::FrameKind::kHello;
    std::string replyHead;
    bool done = false; // the peer is authenticated
    // The error is the peer's proof refused (a wrong secret): what a
    // guesser earns, unlike a malformed or unexpected frame.
    bool proofRefused = false;
  };

  // The channel binding both proofs cover (above); set before the first
  // frame, once the connection's TLS handshake is done.
  void bindTo(std::string binding) {
    binding_ = std::move(binding);
  }
  // Client: the hello to send once the transport is connected.
  std::string hello();
  // The only frame accepted next, and its exact head size.
  frame::FrameKind expectedKind() const;
  size_t expectedHeadBytes() const;
  // Feed the head of the expected frame.
  Step onFrame(const std::string& head);
  // The authenticated peer id (valid once a Step reported done).
  int32_t peerId() const {
    return peerId_;
  }
  uint64_t peerIncarnation() const {
    return peerInc_;
  }
  // Client: our proof is out, the server's not yet in (a close now is the
  // server refusing our proof).
  bool awaitingServerProof() const {
    return stage_ == Stage::kServerProof;
  }

 private:
  // Server: kHello, kProof, kDone. Client: kChallenge, kServerProof, kDone.
  enum class Stage { kHello, kChallenge, kProof, kServerProof, kDone };
  const bool client_;
  const std::string secret_;
  const int32_t selfId_;
  const int32_t expectedPeerId_;
  const int32_t peerIdLimit_; // TransportOptions::peerIdLimit
  const uint64_t selfInc_;
  const AdmitFn admit_;
  Stage stage_;
  int32_t peerId_ = -1;
  uint64_t peerInc_ = 0;
  std::string clientNonce_;
  std::string serverNonce_;
  std::string binding_;
};

} // namespace torch_rpc_ext::transport
