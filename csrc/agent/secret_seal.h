// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// How a group's secret is sealed to one worker in the store (SecretExchange,
// group_secret.h): with X25519 to a public key the worker wrote there, or,
// in a dynamic group given a passphrase by the user, after a
// password-authenticated exchange (CPace, common/cpace.h) in which the
// joiner proves the passphrase to the member that answers it.
//
// Why the second: the store is plain TCP that anyone on its network can
// read. Until session 110 a dynamic group with a user's passphrase kept its
// membership log's proofs under a key drawn from the passphrase itself, so
// one recorded record let a tap of the store test guesses offline. Now such
// a group runs on a secret of 32 random bytes, as a group without a
// passphrase does, and the passphrase only admits joiners to it. What the
// store holds of an exchange (the joiner's nonce and share, the member's
// share, the joiner's confirmation, the sealed secret) gives a guesser
// nothing to test a guess against: whoever runs an exchange learns whether
// one guess was right, a joiner's wrong guess is refused as it is made, and
// a member that refuses (or sees left unconfirmed) kProofStrikes exchanges
// within kStrikeWindow answers no joiner for kProofHoldOff (SecretExchange).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "csrc/common/cpace.h"
#include "csrc/common/crypto.h"

namespace torch_rpc_ext::secret_seal {

constexpr size_t kSecretBytes = 32; // a group-made secret

// The X25519 seal: the AES-128-GCM key that seals the secret from one key
// pair to another (`pubMaker` made it; `pubTaker` takes it; `slot` the
// rank, or minus the request's number), from their shared secret, bound to
// both public keys and the slot. Each pair of fresh keys seals once, so the
// nonce (all zero) never repeats under a key.
std::string sealKey(
    const X25519Key& mine,
    const std::string& peerPublic,
    const std::string& pubMaker,
    const std::string& pubTaker,
    int64_t slot);
std::string sealFor(
    const std::string& key,
    const std::string& secret,
    int64_t slot);
std::optional<std::string> openFor(
    const std::string& key,
    const std::string& sealed,
    int64_t slot);

// ---- A dynamic group's passphrase, proven through the store ----------------
//
//   request/<n>   the joiner's nonce (the exchange's session id) and share
//   sealed/<n>    the member's share (compareSet: one member answers)
//   confirm/<n>   the joiner's confirmation, HMAC under the exchange's key
//   answer/<n>    the secret sealed under that key, or kRefusedProof
//
// The member sends nothing keyed by the exchange before the joiner has
// confirmed, so a joiner that never confirms learns nothing, and one that
// confirms a wrong guess is refused (and counted) at once.
constexpr size_t kRequestBytes = cpace::kSessionIdBytes + cpace::kShareBytes;
constexpr size_t kConfirmBytes = 32;
constexpr size_t kAnswerBytes = kSecretBytes + Aead::kTagBytes;

// The key a passphrase's exchange runs under: drawn from the stretched
// passphrase for this use alone (TLS's exchange is keyed otherwise).
std::string exchangeKey(std::string_view passphrase);

// Answers a member writes where it cannot seal (never the size of a real
// one): the joiner's confirmation was wrong (answer/<n>); the joiner asked
// without a passphrase where the group has one, or with one where the group
// has none (sealed/<n>).
constexpr std::string_view kRefusedProof = "torch_rpc_ext refused: proof";
constexpr std::string_view kRefusedNoPassphrase =
    "torch_rpc_ext refused: the group has a passphrase";
constexpr std::string_view kRefusedPassphrase =
    "torch_rpc_ext refused: the group has no passphrase";

// What a member does about refused (or unconfirmed) proofs: at most
// kProofStrikes exchanges under way, fewer by its strikes; kProofStrikes
// within kStrikeWindow and it answers no joiner for kProofHoldOff (the
// transports' hold-off on refused sources, source_strikes.h, by the same
// numbers; the store says nothing of who wrote a request, so it holds off
// every joiner).
constexpr int kProofStrikes = 8;
constexpr auto kStrikeWindow = std::chrono::seconds(10);
constexpr auto kProofHoldOff = std::chrono::seconds(30);
// An exchange the joiner has not confirmed this long after the member's
// share counts as a strike too (a joiner confirms within a 20 ms poll):
// requests written only to hold a member's places, up to kProofStrikes at a
// time, show as a hold-off instead of keeping every joiner waiting unseen.
constexpr auto kConfirmWithin = std::chrono::seconds(5);
// And a joiner: each exchange it confirms tells whoever answered it whether
// one guess was right, so one that confirmed kMaxUnansweredProofs answers
// which never sealed the secret (a member that went mid-exchange, rare; or
// a store writer posing as a member, which could otherwise make it confirm
// a new guess every half second by moving the epoch) fails its init_rpc.
constexpr int kMaxUnansweredProofs = 3;

// The joiner's end of request n of `epoch`. Throws std::runtime_error where
// libcrypto cannot do X25519.
class JoinerProof {
 public:
  JoinerProof(std::string_view passphrase, int64_t epoch, int64_t n);
  // What request/<n> holds (kRequestBytes).
  const std::string& request() const {
    return request_;
  }
  // The confirmation to write from the member's share (kConfirmBytes);
  // nullopt for a share no member sends (the store was written by someone
  // else).
  std::optional<std::string> confirm(std::string_view memberShare);
  // The secret from answer/<n>: nullopt if it does not open.
  std::optional<std::string> open(std::string_view answer) const;

 private:
  const int64_t epoch_;
  const int64_t n_;
  cpace::Exchange exchange_;
  std::string request_;
  std::string key_; // the exchange's, once confirm() had the member's share
};

// The member's end of request n: from the joiner's request (throws
// std::invalid_argument for one of another size, std::runtime_error where
// libcrypto cannot do X25519).
class MemberProof {
 public:
  MemberProof(
      std::string_view passphrase,
      int64_t epoch,
      int64_t n,
      std::string_view request);
  // What sealed/<n> holds (cpace::kShareBytes).
  const std::string& share() const {
    return exchange_.share();
  }
  // `secret` sealed for answer/<n> if the joiner's confirmation is right;
  // nullopt if it is not (a wrong passphrase, or a share that was no
  // joiner's).
  std::optional<std::string> answer(
      std::string_view confirmation,
      const std::string& secret) const;

 private:
  const int64_t epoch_;
  const int64_t n_;
  const std::string joinerShare_;
  cpace::Exchange exchange_;
};

} // namespace torch_rpc_ext::secret_seal
