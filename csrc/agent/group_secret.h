// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace torch_rpc_ext {

// A group's secret when the user gave none (docs/security.md, "The group
// secret"): made by one worker and sealed with X25519 to each other's
// public key, so that the store, and a reader of its traffic, hold public
// keys and sealed bytes only. In a static group rank 0 makes it and seals
// it to every rank; in a dynamic group whoever comes first makes it, and
// the members seal it to each joiner (serve(), from the group's watcher).
// group_secret.cpp says which keys of the store it uses.
//
// Threads: the init thread (forStaticGroup, forDynamicGroup, noteJoined),
// then the group's watcher thread (serve).
class SecretExchange {
 public:
  SecretExchange(
      c10::intrusive_ptr<::c10d::Store> store,
      std::string selfName,
      int64_t rank);

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
  // over with another secret): false before we hold one, and for a secret
  // of the user's.
  bool epochEnded() const;
  // Where the group's membership log lives under its store: "e<epoch>/"
  // for a secret the group made (each epoch's group is new: its own log,
  // which the records of an earlier epoch's, proven under another secret,
  // never mix with), "" for the user's.
  std::string logPrefix() const;
  // Seal `secret` to every joiner that asked since the last call (a no-op
  // unless forDynamicGroup gave us the secret).
  void serve(const std::string& secret);
  // Requests counted and not yet answered, as serve() last left them (any
  // thread): rpc_ext.membership.secret_requests_waiting.
  int64_t waiting() const {
    return waitingNow_.load(std::memory_order_relaxed);
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
  struct Waiting {
    Clock::time_point counted;
    Clock::time_point nextLook;
  };
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

  const c10::intrusive_ptr<::c10d::Store> store_;
  const std::string selfName_;
  const int64_t rank_;
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
};

} // namespace torch_rpc_ext
