// SPDX-License-Identifier: BSD-3-Clause
//
// Fuzzes transport::Handshake (csrc/transport/handshake.h), both roles: the
// only code that parses what an unauthenticated peer sends. The harness plays
// the peer. Each step it sends a raw head, or the frame an honest peer would
// send next (computing the HMAC proofs itself, from the nonces it has seen,
// so the deeper states are reached), or that frame with a byte flipped or
// resized. It feeds frames in every state, including after the handshake is
// done, and stops after the first error, as a connection closes then.
//
// Input: uint8 config (bit 0: fuzz the client role, else the server; bit 1:
// the peer uses a wrong secret; bit 2: the peer claims the id the client
// expects), int32 selfId, int32 expectedPeerId, int32 peerId; then up to
// kMaxSteps steps, each a uint8 op and its operands (see nextHead()).
//
// A finding: a sanitizer report; an accepted frame an honest peer without
// the secret could not have produced (a wrong proof or id, a proof not bound
// to both nonces and ids); a correct frame refused; a reply that is not what
// the protocol prescribes; a step that both fails and replies or completes;
// expectedKind()/expectedHeadBytes() inconsistent with the state.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "csrc/common/crypto.h"
#include "csrc/transport/handshake.h"
#include "tests/fuzz/fuzz_input.h"

namespace torch_rpc_ext::fuzz {
namespace {

using frame::FrameKind;
using transport::Handshake;
using transport::kChallengeBytes;
using transport::kHelloBytes;
using transport::kNonceBytes;
using transport::kProofBytes;

constexpr size_t kMaxSteps = 6;
const std::string kSecret = "fuzz-group-secret-0123456789abcd";
const std::string kWrongSecret = "fuzz-group-secret-0123456789abcX";

std::string le32(int32_t v) {
  char b[4];
  std::memcpy(b, &v, 4);
  return std::string(b, 4);
}

int32_t idAt(const std::string& s, size_t at) {
  int32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}

std::string le64(uint64_t v) {
  char b[8];
  std::memcpy(b, &v, 8);
  return std::string(b, 8);
}

uint64_t incAt(const std::string& s, size_t at) {
  uint64_t v;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}

// The incarnation of the end under test, and its admission rule (the
// agent's is "the current holder of the id"): odd incarnations are refused.
constexpr uint64_t kSelfInc = 0x1122334455667788ULL;
constexpr size_t kNonceAt = 12; // after the id and the incarnation

std::string admitEven(int32_t id, uint64_t inc) {
  return inc % 2 == 0 ? "" : "odd incarnation";
}

// The protocol's proof, written out here independently of makeProof().
std::string proof(
    const std::string& secret,
    const char* role,
    const std::string& clientNonce,
    const std::string& serverNonce,
    int32_t clientId,
    int32_t serverId,
    uint64_t clientInc,
    uint64_t serverInc) {
  Digest d = hmacSha256(
      secret,
      std::string("torch_rpc_ext/3/") + role + clientNonce + serverNonce +
          le32(clientId) + le32(serverId) + le64(clientInc) + le64(serverInc));
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

std::string nonceFrom(FuzzInput& in) {
  std::string n = in.takeBytes(kNonceBytes);
  n.resize(kNonceBytes, '\0');
  return n;
}

// What the peer knows, and the frame an honest peer would send next.
struct Peer {
  bool client; // the role under test is the client (the peer is a server)
  std::string secret;
  int32_t id;
  // Learnt from the frames exchanged so far.
  std::string clientNonce;
  std::string serverNonce;
  int32_t clientId = 0;
  int32_t serverId = 0;
  uint64_t clientInc = 0;
  uint64_t serverInc = 0;
  std::string lastValid; // replayed once the handshake is done

  std::string validNext(FuzzInput& in, bool done) {
    if (done) {
      return lastValid;
    }
    if (client) {
      if (serverNonce.empty()) {
        // A challenge to the client's hello; what the client saw is taken
        // from the head it accepted.
        uint64_t inc = in.take<uint64_t>();
        lastValid = le32(id) + le64(inc) + nonceFrom(in);
      } else {
        // The server's proof, after the client's.
        lastValid = proof(
            secret,
            "server",
            clientNonce,
            serverNonce,
            clientId,
            serverId,
            clientInc,
            serverInc);
      }
    } else if (clientNonce.empty()) {
      // A hello; what the server saw is taken from the head it accepted.
      uint64_t inc = in.take<uint64_t>();
      lastValid = le32(id) + le64(inc) + nonceFrom(in);
    } else {
      lastValid = proof(
          secret,
          "client",
          clientNonce,
          serverNonce,
          clientId,
          serverId,
          clientInc,
          serverInc);
    }
    return lastValid;
  }

  // The head of one step. Ops (low two bits): 0 raw (uint8 length, bytes);
  // 1 the valid frame; 2 it with one byte xored (uint8 position, uint8
  // mask); 3 it resized (uint8 length; growth filled from the input).
  std::string nextHead(FuzzInput& in, bool done) {
    uint8_t op = in.take<uint8_t>();
    if ((op & 3) == 0) {
      return in.takeBytes(in.take<uint8_t>());
    }
    std::string head = validNext(in, done);
    if ((op & 3) == 2 && !head.empty()) {
      size_t at = in.take<uint8_t>() % head.size();
      uint8_t mask = in.take<uint8_t>();
      head[at] = char(uint8_t(head[at]) ^ (mask == 0 ? 1 : mask));
    } else if ((op & 3) == 3) {
      size_t n = in.take<uint8_t>();
      if (n > head.size()) {
        head += in.takeBytes(n - head.size());
      }
      head.resize(n, '\0');
    }
    return head;
  }
};

void checkStepShape(const Handshake::Step& step) {
  FUZZ_CHECK(
      step.error.empty() || (!step.hasReply && !step.done),
      "a failed step replied or completed: " + step.error);
  FUZZ_CHECK(
      !step.error.empty() || step.hasReply || step.done,
      "a step neither failed, replied nor completed");
}

void fuzzClient(FuzzInput& in, Peer& peer, int32_t selfId, int32_t expected) {
  Handshake hs(true, kSecret, selfId, expected, 0, kSelfInc, admitEven);
  std::string hello = hs.hello();
  FUZZ_CHECK(hello.size() == kHelloBytes, "hello of the wrong size");
  FUZZ_CHECK(idAt(hello, 0) == selfId, "hello names another id");
  FUZZ_CHECK(incAt(hello, 4) == kSelfInc, "hello names another incarnation");
  peer.clientId = selfId;
  peer.clientInc = kSelfInc;
  peer.clientNonce = hello.substr(kNonceAt, kNonceBytes);
  enum { kChallenge, kServerProof, kDone } stage = kChallenge;
  for (size_t i = 0; i < kMaxSteps && !in.empty(); ++i) {
    FUZZ_CHECK(
        hs.expectedKind() ==
            (stage == kChallenge ? FrameKind::kChallenge : FrameKind::kProof),
        "client expects the wrong kind");
    FUZZ_CHECK(
        hs.expectedHeadBytes() ==
            (stage == kChallenge ? kChallengeBytes : kProofBytes),
        "client expects the wrong head size");
    std::string head = peer.nextHead(in, stage == kDone);
    Handshake::Step step = hs.onFrame(head);
    checkStepShape(step);
    if (stage == kDone) {
      FUZZ_CHECK(!step.error.empty(), "a frame after the handshake passed");
      return;
    }
    if (stage == kChallenge) {
      bool wellFormed =
          head.size() == kChallengeBytes && idAt(head, 0) == expected;
      FUZZ_CHECK(
          step.error.empty() == wellFormed,
          wellFormed ? "client refused a well-formed challenge: " + step.error
                     : std::string("client accepted a bad challenge"));
      if (!wellFormed) {
        return;
      }
      FUZZ_CHECK(!step.done, "client completed before the server's proof");
      peer.serverId = idAt(head, 0);
      peer.serverInc = incAt(head, 4);
      peer.serverNonce = head.substr(kNonceAt, kNonceBytes);
      FUZZ_CHECK(
          step.hasReply && step.replyKind == FrameKind::kProof &&
              step.replyHead ==
                  proof(
                      kSecret,
                      "client",
                      peer.clientNonce,
                      peer.serverNonce,
                      selfId,
                      expected,
                      kSelfInc,
                      peer.serverInc),
          "client did not answer a challenge with its proof");
      stage = kServerProof;
      continue;
    }
    bool correct = peer.serverInc % 2 == 0 &&
        head ==
            proof(
                kSecret,
                "server",
                peer.clientNonce,
                peer.serverNonce,
                selfId,
                expected,
                kSelfInc,
                peer.serverInc);
    FUZZ_CHECK(
        step.done == correct,
        step.done ? "client accepted a bad server proof"
                  : "client refused a correct server proof: " + step.error);
    if (!step.done) {
      return;
    }
    FUZZ_CHECK(!step.hasReply, "client replied to the server's proof");
    FUZZ_CHECK(hs.peerId() == expected, "client authenticated another id");
    FUZZ_CHECK(
        hs.peerIncarnation() == peer.serverInc,
        "client authenticated another incarnation");
    stage = kDone;
  }
}

void fuzzServer(FuzzInput& in, Peer& peer, int32_t selfId, int32_t expected) {
  Handshake hs(false, kSecret, selfId, expected, 0, kSelfInc, admitEven);
  enum { kHello, kProof, kDone } stage = kHello;
  for (size_t i = 0; i < kMaxSteps && !in.empty(); ++i) {
    FUZZ_CHECK(
        hs.expectedKind() ==
            (stage == kHello ? FrameKind::kHello : FrameKind::kProof),
        "server expects the wrong kind");
    FUZZ_CHECK(
        hs.expectedHeadBytes() == (stage == kHello ? kHelloBytes : kProofBytes),
        "server expects the wrong head size");
    std::string head = peer.nextHead(in, stage == kDone);
    Handshake::Step step = hs.onFrame(head);
    checkStepShape(step);
    if (stage == kDone) {
      FUZZ_CHECK(!step.error.empty(), "a frame after the handshake passed");
      return;
    }
    if (stage == kHello) {
      bool wellFormed = head.size() == kHelloBytes && idAt(head, 0) >= 0;
      FUZZ_CHECK(
          step.error.empty() == wellFormed,
          wellFormed ? "server refused a well-formed hello: " + step.error
                     : std::string("server accepted a malformed hello"));
      if (!wellFormed) {
        return;
      }
      FUZZ_CHECK(!step.done, "server completed on a hello");
      // A nonce and who it is: nothing computed from the secret.
      FUZZ_CHECK(
          step.hasReply && step.replyKind == FrameKind::kChallenge &&
              step.replyHead.size() == kChallengeBytes,
          "server did not answer a hello with a challenge");
      peer.clientId = idAt(head, 0);
      peer.clientInc = incAt(head, 4);
      peer.clientNonce = head.substr(kNonceAt, kNonceBytes);
      peer.serverId = idAt(step.replyHead, 0);
      peer.serverInc = incAt(step.replyHead, 4);
      peer.serverNonce = step.replyHead.substr(kNonceAt, kNonceBytes);
      FUZZ_CHECK(peer.serverId == selfId, "challenge names another id");
      FUZZ_CHECK(
          peer.serverInc == kSelfInc, "challenge names another incarnation");
      FUZZ_CHECK(peer.serverNonce != peer.clientNonce, "nonce echoed back");
      stage = kProof;
      continue;
    }
    bool correct = peer.clientInc % 2 == 0 &&
        head ==
            proof(
                kSecret,
                "client",
                peer.clientNonce,
                peer.serverNonce,
                peer.clientId,
                selfId,
                peer.clientInc,
                kSelfInc);
    FUZZ_CHECK(
        step.done == correct,
        step.done ? "server accepted a bad proof"
                  : "server refused a correct proof: " + step.error);
    if (!step.done) {
      return;
    }
    // Only now the server proves the secret in turn.
    FUZZ_CHECK(
        step.hasReply && step.replyKind == FrameKind::kProof &&
            step.replyHead ==
                proof(
                    kSecret,
                    "server",
                    peer.clientNonce,
                    peer.serverNonce,
                    peer.clientId,
                    selfId,
                    peer.clientInc,
                    kSelfInc),
        "server did not answer a correct proof with its own");
    FUZZ_CHECK(hs.peerId() == peer.clientId, "server authenticated another id");
    FUZZ_CHECK(
        hs.peerIncarnation() == peer.clientInc,
        "server authenticated another incarnation");
    stage = kDone;
  }
}

int fuzzOne(const uint8_t* data, size_t size) {
  FuzzInput in(data, size);
  uint8_t config = in.take<uint8_t>();
  int32_t selfId = in.take<int32_t>();
  int32_t expected = in.take<int32_t>();
  int32_t peerId = in.take<int32_t>();
  Peer peer;
  peer.client = (config & 1) != 0;
  peer.secret = (config & 2) != 0 ? kWrongSecret : kSecret;
  peer.id = (config & 4) != 0 ? expected : peerId;
  if (peer.client) {
    fuzzClient(in, peer, selfId, expected);
  } else {
    fuzzServer(in, peer, selfId, expected);
  }
  return 0;
}

} // namespace
} // namespace torch_rpc_ext::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return torch_rpc_ext::fuzz::fuzzOne(data, size);
}
