// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "csrc/agent/secret_seal.h"
#include "csrc/common/crypto.h"

namespace torch_rpc_ext {

// A group's secret when the user gave none (docs/security.md, "The group
// secret"): made by one worker and sealed with X25519 to each other's
// public key, so that the store, and a reader of its traffic, hold public
// keys and sealed bytes only. In a static group rank 0 makes it and seals
// it to every rank; in a dynamic group whoever comes first makes it, and
// the members seal it to each joiner (serve(), from the group's watcher).
// group_secret.cpp says which keys of the store it uses.
//
// A dynamic group given a passphrase by the user (`passphrase`, stretched)
// runs on a secret made the same way; the passphrase admits joiners to it,
// each proving it to the member that answers (secret_seal.h).
//
// Threads: the init thread (forStaticGroup, forDynamicGroup, noteJoined),
// then the group's watcher thread (serve).
class SecretExchange {
 public:
  SecretExchange(
      c10::intrusive_ptr<::c10d::Store> store,
      std::string selfName,
      int64_t rank,
      std::string passphrase);

  // Rank 0 makes the secret and seals it to every other rank of
  // `worldSize`; the others open theirs. Throws naming the problem.
  std::string forStaticGroup(int worldSize);
  // Whether the listener a member published (its name, its offers)
  // accepts a connection within the time given: GroupListener's.
  using ListenerAnswers = std::function<bool(
      const std::string& name,
      const std::string& offers,
      std::chrono::milliseconds within)>;
  // Makes the secret if we come first (or the group has nobody alive to
  // seal it: members whose lease lapsed and whose listener does not answer,
  // or has answered for kMaxLeaseProbing leases past the lapse, count as
  // gone, as members judge each other; `lease` where the log lists none),
  // else waits up to `timeout` for a member to seal it to us. Throws naming
  // the problem.
  std::string forDynamicGroup(
      std::chrono::milliseconds timeout,
      std::chrono::milliseconds lease,
      const ListenerAnswers& answers);
  // We joined the dynamic group: its epoch has had a member, and our
  // request for the secret and its answer leave the store. False if the
  // epoch ended meanwhile (the group started over with another secret).
  bool noteJoined();
  // Whether the epoch whose secret we hold has ended (the group started
  // over with another secret): false before we hold one (a static group).
  bool epochEnded() const;
  // Where a dynamic group's membership log lives under its store:
  // "e<epoch>/" (each epoch's group is new: its own log, which the records
  // of an earlier epoch's, proven under another secret, never mix with).
  std::string logPrefix() const;
  // Seal `secret` to every joiner that asked since the last call (a no-op
  // unless forDynamicGroup gave us the secret). True while an exchange of
  // ours waits on its joiner's confirmation (the watcher looks again soon).
  bool serve(const std::string& secret);
  // Requests counted and not yet answered, as serve() last left them (any
  // thread): rpc_ext.membership.secret_requests_waiting.
  int64_t waiting() const {
    return waitingNow_.load(std::memory_order_relaxed);
  }
  // Joiners' proofs of the passphrase we refused, the times that made us
  // hold off every joiner, and whether we do now (any thread):
  // rpc_ext.membership.secret_proofs_refused, secret_hold_offs,
  // secret_held_off.
  int64_t proofsRefused() const {
    return proofsRefused_.load(std::memory_order_relaxed);
  }
  int64_t holdOffs() const {
    return holdOffs_.load(std::memory_order_relaxed);
  }
  bool heldOff() const {
    return heldOffNow_.load(std::memory_order_relaxed);
  }

 private:
  using Clock = std::chrono::steady_clock;
  // A listed member's lease counter, and since when we have seen it.
  struct Beat {
    int64_t count;
    Clock::time_point since;
  };
  // The members the membership log lists whose lease was renewed within
  // their own lease (`lease` where the log has none; `beats`: what the
  // caller saw of them so far).
  size_t liveMembers(
      int64_t epoch,
      std::chrono::milliseconds lease,
      Clock::time_point now,
      std::map<uint64_t, Beat>& beats,
      const ListenerAnswers& answers) const;
  // Ends `epoch` (nobody alive holds its secret): moves the store's epoch
  // counter past it in one compareSet, unless it moved on already.
  void endEpoch(int64_t epoch) const;
  // A request counted and not yet answered: when we counted it, and when
  // we look for its key next.
  // With a passphrase, the exchange we answered it with (`counted` is then
  // when we did).
  struct Waiting {
    Clock::time_point counted;
    Clock::time_point nextLook;
    std::shared_ptr<secret_seal::MemberProof> proof = nullptr;
    // Its judgment, once made: the sealed secret, or the refusal.
    std::optional<std::string> answer = std::nullopt;
  };
  // A joiner's request under way (forDynamicGroup): with a passphrase, its
  // exchange, and whether (since when) we confirmed it.
  struct Asking {
    int64_t epoch;
    int64_t n;
    const X25519Key& key;
    std::optional<secret_seal::JoinerProof> proof = std::nullopt;
    bool confirmed = false;
    Clock::time_point confirmedAt{};
    // Confirmed, and unanswered for kUnwrittenGrace since.
    bool unanswered(Clock::time_point now) const;
  };
  // The secret, once a member's answer to request `a` is in the store;
  // nullopt while there is none yet (or, with a passphrase, when it was
  // our turn to confirm). Throws for an answer that refuses or does not
  // open.
  std::optional<std::string> takeAnswer(Asking& a);
  // With a passphrase: our share for request n (`request`, the joiner's),
  // false while the exchange waits on its joiner (`w` holds it); then its
  // confirmation judged and answered, true once that is done or the joiner
  // went (watcher thread).
  bool offerProof(
      int64_t n,
      Waiting& w,
      Clock::time_point now,
      const std::string& request);
  bool answerProof(
      int64_t n,
      Waiting& w,
      Clock::time_point now,
      const std::string& secret);
  // Whether we may answer one more joiner's request with our share: not
  // held off, and fewer exchanges under way than strikes left in the
  // window (watcher thread).
  bool mayOffer(Clock::time_point now);
  // An exchange refused or left unconfirmed (`what`, for the log): a
  // strike, and the hold-off at kProofStrikes.
  void strike(Clock::time_point now, const char* what);
  // Seal `secret` to request n of our epoch: false to look again later
  // (its key is not there yet: `w.nextLook` moved on), true when it needs
  // nothing more of us (watcher thread).
  bool sealTo(
      int64_t n,
      Waiting& w,
      Clock::time_point now,
      const std::string& secret);
  // Deletes the store's keys of request n of `epoch` (its joiner holds the
  // secret): a long-lived group's store keeps nothing per join of this.
  void forgetRequest(int64_t epoch, int64_t n) const;

  // How long a member looks for a counted request's key before it lets the
  // request go (and, with a passphrase, for the confirmation of one it
  // answered). A joiner writes it right after counting it, so past this the
  // request was answered and deleted, or its joiner died; one whose count
  // and write took longer asks again, under a new number.
  static constexpr auto kUnwrittenGrace = std::chrono::seconds(10);
  // Key `what` of `epoch`'s exchange under torch_rpc_ext/dyn_secret/.
  static std::string dynKey(int64_t epoch, const std::string& what);

  const c10::intrusive_ptr<::c10d::Store> store_;
  const std::string selfName_;
  const int64_t rank_;
  const std::string passphrase_; // the user's, stretched; empty: none
  int64_t epoch_ = -1; // the dynamic group's secret epoch we hold
  // Our request's number there (0: we made the secret); its keys go once
  // we joined (noteJoined).
  int64_t mine_ = 0;
  // When our count of it returned: a request counted before ours was
  // counted before then, so by kUnwrittenGrace after it its joiner has
  // written it or asked again under a new number.
  Clock::time_point mineCounted_{};
  // Requests of that epoch counted so far, and those not yet sealed whose
  // key was not there when we looked, with when we counted them (watcher
  // thread).
  int64_t served_ = 0;
  std::map<int64_t, Waiting> waiting_;
  std::atomic<int64_t> waitingNow_{0};
  // Strikes (exchanges refused or left unconfirmed) within kStrikeWindow,
  // and until when we answer no joiner (watcher thread); what the metrics
  // read.
  std::deque<Clock::time_point> strikes_;
  Clock::time_point heldUntil_{};
  size_t proofsInFlight_ = 0; // waiting_'s entries with an exchange
  std::atomic<int64_t> proofsRefused_{0};
  std::atomic<int64_t> holdOffs_{0};
  std::atomic<bool> heldOffNow_{false};
};

} // namespace torch_rpc_ext
