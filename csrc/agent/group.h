// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The group: who the members are and how that changes (docs/elastic.md).
//
// A static group (init_rpc with world_size) is settled once, at rendezvous:
// every worker publishes its entry in the store and reads everyone's; the
// view never changes; join() is a barrier of store rounds. A dynamic group
// (world_size=None) is a membership log in the store (membership.h): the
// group joins by appending its record, a watcher thread applies the others'
// records and renews our lease, the leases of the others are judged
// (group_leases.cpp), and leaving appends a leave record. The difference
// stays inside: the agent asks the same questions of either (a peer by id
// or name, the current view) and hears from it through GroupListener.
//
// Files: group.cpp (start-up, lookups, the static group's rounds),
// group_elastic.cpp (the dynamic group's join, watcher, log, leave),
// group_leases.cpp (whether the members of a dynamic group are alive; their
// acknowledgements; a joiner's and a leaver's waits on the log).
//
// Threads and locks:
//  - view(), peerById(), memberOn(), worker(): any thread, on every call and
//    frame; viewMutex_ guards only the pointer to the immutable View.
//  - peersMutex_ guards peers_ (every Peer ever seen; never shrinks).
//  - rosterMutex_ guards the roster and everything the watcher owns
//    (leases_, ackedEpoch_, snapshotWritten_, joinRefusal_): the watcher
//    thread, and the threads joining and leaving, apply the log under it.
//    GroupListener's onDeparted() and onFenced() run under it.
//  - eventsMutex_ guards events_, reportEvents_, eventsClosed_
//    (takeEvents() runs on the Python event thread).
//  - watcherMutex_ guards watcherStop_ and watcher_ (the thread object).
// The lock order is rosterMutex_, then viewMutex_ / peersMutex_ /
// eventsMutex_ (each held alone); and watcherJoinMutex_, watcherMutex_,
// eventsMutex_ (startWatcher). No lock of ours is held while the
// listener's probe(), listenerAnswers() or whyUnreachable() run except
// rosterMutex_ (probe() from a lease check).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/rpc/rpc_agent.h>

#include "csrc/agent/group_secret.h"
#include "csrc/agent/membership.h"
#include "csrc/agent/options.h"

namespace torch_rpc_ext {

// What the group needs from the rest of the agent (the Agent implements it;
// unit tests, a fake). Calls come from the membership watcher thread and
// the threads joining or leaving.
class GroupListener {
 public:
  virtual ~GroupListener() = default;

  // How we reach a worker that offers `offers` (its rendezvous entry after
  // the name line); throws if no transport of ours does.
  virtual Route routeFor(
      const std::string& name,
      const std::string& offers) = 0;
  // Whether a member whose lease lapsed answers on the transport.
  enum class Probe { kReady, kConnecting, kUnreachable };
  virtual Probe probe(const Peer& peer) = 0;
  // Per peer, why it is unreachable ("" if it may still answer). The
  // static join barrier's check on the workers it waits for (`dial`):
  // connect to each, give the connections `within` to settle. Without
  // `dial` (the shutdown watch), a peer we hold no connection to is only
  // knocked on (its listener refusing within `within`), so that watching a
  // worker opens no connection, channels and all, to it.
  virtual std::vector<std::string> whyUnreachable(
      const std::vector<const Peer*>& peers,
      std::chrono::milliseconds within,
      bool dial) = 0;
  // Whether the listener a member published accepts a connection within
  // `within` (a joiner probing the holder of its rank: it cannot handshake
  // with a group it is not in yet).
  virtual bool listenerAnswers(
      const std::string& name,
      const std::string& offers,
      std::chrono::milliseconds within) = 0;
  // `peer` left or was declared `dead` (it is marked departed already): its
  // connections and what it left in torch's RRef state go.
  virtual void onDeparted(const Peer& peer, bool dead) = 0;
  // The log declared us dead: no connection of ours may stay.
  virtual void onFenced(const std::string& reason) = 0;
  // Before our join record: our RRef and autograd ids must start past every
  // earlier holder's of `rank` (torch derives them from the rank alone).
  virtual void reserveIds(int32_t rank, int64_t generation) = 0;
  // Requests we are serving (a leave waits for them).
  virtual int64_t callsBeingServed() = 0;
};

// A random nonzero incarnation (membership.h).
uint64_t drawIncarnation();

class Group {
 public:
  // worldSize 0: a dynamic group. `options`: the secret, heartbeat and
  // rendezvous timeouts (outlives the group, as `listener` does).
  Group(
      c10::intrusive_ptr<::c10d::Store> store,
      rpc::WorkerInfo self,
      int worldSize,
      const AgentOptions& options,
      GroupListener& listener);
  ~Group();

  // ---- Start-up, in this order ----
  // The group's secret (every handshake proves it): a static group's the
  // options', or from the store (rank 0 makes it); a dynamic group's from
  // the store (whoever comes first makes it; a passphrase of the user's
  // only admits joiners). Draws our incarnation in a dynamic group.
  const std::string& establishSecret();
  // What establishSecret() gave (tests: a handshake of their own).
  const std::string& secret() const {
    return secret_;
  }
  // Publish our rendezvous `entry` (name line, offers) and learn everyone
  // else's (static: blocks until all worldSize workers have published), or
  // join the dynamic group's log (our record adds our devices and maps):
  // returns once every member knows us.
  void join(const std::string& entry, std::chrono::milliseconds rpcTimeout);

  bool isDynamic() const {
    return worldSize_ == 0;
  }
  // Ours: random per join; 0 in a static group.
  uint64_t incarnation() const {
    return incarnation_;
  }

  // ---- Lookups (any thread) ----
  // The current members. Loaded per call (one shared_ptr copy).
  std::shared_ptr<const View> view() const {
    std::lock_guard<std::mutex> lock(viewMutex_);
    return view_;
  }
  // The current holder of `id` (no copy of the view), or null.
  Peer* peerById(int64_t id) const;
  // The current holder of `id`, if it is the incarnation `incarnation`.
  Peer* memberOn(int32_t id, uint64_t incarnation) const;
  // The newest holder of `name` ever seen, member or departed, or null.
  std::shared_ptr<Peer> lastPeerNamed(const std::string& name) const;
  // Every peer ever seen, oldest first.
  std::vector<std::shared_ptr<Peer>> everyPeer() const;
  // A member by name or id; throws upstream's text, with why it is missing
  // (departed, or the names known).
  const rpc::WorkerInfo& worker(const std::string& name) const;
  const rpc::WorkerInfo& worker(rpc::worker_id_t id) const;
  // Why a peer authenticated as `id` with `incarnation` may not stay ("" if
  // it may): it must be the current holder of the id.
  std::string admissionError(int32_t id, uint64_t incarnation) const;
  // Set when the log says we were declared dead: every send fails.
  bool fenced() const {
    return fenced_.load();
  }
  const std::string& fencedReason() const {
    return fencedReason_;
  }

  // ---- Join and leave ----
  // Static: one barrier of join(): publish `value`, wait for every worker's
  // (failing with the names of the missing, or of an unreachable one,
  // rather than waiting forever), return the sum.
  int64_t barrier(
      int64_t value,
      std::optional<std::chrono::steady_clock::time_point> deadline,
      float timeout);
  // Per name, why that worker cannot be reached now (the listener's
  // whyUnreachable, `dial` as there): "" if it can, or may still
  // (connecting after `within`), "not a member" for a name we do not hold.
  // rpc.shutdown()'s gather watches the workers it waits on with it, not
  // dialling (torch_rpc_ext/_torch_private.py, watched_wait_all_workers).
  std::vector<std::string> whyUnreachable(
      const std::vector<std::string>& names,
      std::chrono::milliseconds within,
      bool dial);
  // Static: the last barrier of a graceful shutdown, which nobody must
  // outlive while others still use the store (group.cpp).
  void leaveBarrier(
      std::optional<std::chrono::steady_clock::time_point> deadline,
      float timeout);
  // Dynamic: record our leave, wait for the members to acknowledge it and
  // for the calls we serve to finish, stop the watcher.
  void leave(std::optional<std::chrono::steady_clock::time_point> deadline);
  // Stop applying the log (recording our leave if not done): before torch
  // tears down its RRef state at shutdown. Idempotent.
  void stop();
  // Membership changes applied since our join and not taken yet, in epoch
  // order, waiting up to `timeout` for one; nullopt once stopped.
  std::optional<std::vector<MembershipEvent>> takeEvents(
      std::chrono::milliseconds timeout);

  // rpc_ext.membership.* (get_metrics; dynamic groups).
  void addMetrics(std::unordered_map<std::string, std::string>& m) const;

  // Stops the watcher thread, without leaving: no more lease renewals or
  // secrets sealed (stop() does this after its leave; tests freeze a member
  // so, as a stopped process is). Any thread, any number of times.
  void stopWatcher();
  // Starts it, if it is not running: once joined (joinLog), and again in
  // tests, as a stopped process is continued.
  void startWatcher();

 private:
  void publish(std::shared_ptr<const View> view);
  // worker()'s error: "... could not find destination <what>".
  [[noreturn]] void notFound(const std::string& what) const;
  std::shared_ptr<Peer> adopt(
      rpc::WorkerInfo info,
      uint64_t incarnation,
      Route route);
  // ---- Dynamic groups (group_elastic.cpp) ----
  void joinLog(const std::string& entry, std::chrono::milliseconds rpcTimeout);
  // Our leave, appended at once; a store that fails it is said (`what` we
  // could not do), and our lease runs out instead.
  // (After `after` too: our join there, which a leave before it would
  // precede.)
  void recordLeave(const std::string& what, int64_t after = 0);
  // joinLog's steps; `appended` once our join record may be in the log
  // (set before the append: a store that fails may have taken it),
  // `readBack` once we applied the log up to it.
  void joinRecorded(
      const std::string& entry,
      std::chrono::milliseconds rpcTimeout,
      bool& appended,
      bool& readBack,
      int64_t& joinedAt);
  void watch();
  // Apply what the log holds past our roster; true if anything changed.
  bool catchUp();
  void applyEvent(const MembershipEvent& ev);
  // We are out of the group, for `reason`: every send fails from now on
  // (rosterMutex_ held; once).
  void fence(const std::string& reason);
  // ---- Leases and acknowledgements (group_leases.cpp) ----
  // Acknowledge the epoch applied, if not yet (rosterMutex_ held).
  void ackApplied();
  // Wait until every member of the current view other than us has
  // acknowledged `epoch` (or departed); false at `deadline`.
  bool awaitAcks(
      int64_t epoch,
      std::chrono::steady_clock::time_point deadline,
      std::vector<std::string>* missing);
  // How long a member's lease may go unrenewed before it is declared dead:
  // the heartbeat timeout (its default when heartbeats are off).
  std::chrono::milliseconds leaseTimeout() const;
  void checkLeases();
  // Whether the epoch of the secret the group made ended under us: fenced
  // if our own lease had lapsed, else said once (watcher thread).
  void checkOurEpoch(std::chrono::steady_clock::time_point now);

  // Whether a member whose lease lapsed answers on the transport.
  bool reachable(const Member& m);
  // Joining: wait until `held` (holding our rank or name) is gone: it
  // leaves, or its lease lapses and we declare it dead; throws if it is
  // alive, or at `deadline` (which the wait may extend).
  void awaitHolderGone(
      Member held,
      const Member& me,
      std::chrono::steady_clock::time_point& deadline,
      std::unique_lock<std::mutex>& lock);
  // Joining or leaving: apply the log up to our own record at `epoch`
  // (`lock` holds rosterMutex_, let go between reads). Every slot before
  // it was claimed before ours, so one read is enough unless the store
  // lost one (a record deleted or written over by a store writer): false
  // at `deadline`, with `stuck` the first slot that reads empty.
  bool catchUpTo(
      int64_t epoch,
      std::chrono::steady_clock::time_point deadline,
      std::unique_lock<std::mutex>& lock,
      int64_t& stuck);

  const c10::intrusive_ptr<::c10d::Store> store_;
  const rpc::WorkerInfo self_;
  const int worldSize_; // 0: a dynamic group
  const AgentOptions& options_;
  GroupListener& listener_;
  std::string secret_;
  // How the group shares the secret it makes (a static group without a
  // user's secret, every dynamic group).
  SecretExchange exchange_;
  uint64_t incarnation_ = 0; // ours; 0 in a static group

  // (A mutex, not std::atomic<std::shared_ptr>: libstdc++ 12's has had
  // races; an uncontended lock costs about as much.)
  mutable std::mutex viewMutex_;
  std::shared_ptr<const View> view_;
  mutable std::mutex peersMutex_;
  std::vector<std::shared_ptr<Peer>> peers_; // every peer ever seen
  // Their statistics, one per name (Peer::stats).
  std::unordered_map<std::string, std::shared_ptr<PeerStats>> statsByName_;
  int64_t joinRounds_ = 0; // static barriers passed (same on every worker)

  // ---- A dynamic group's log, applied by the watcher ----
  std::unique_ptr<MembershipLog> log_;
  std::mutex rosterMutex_;
  Roster roster_;
  int64_t ackedEpoch_ = 0;
  // The snapshot we started from (0: epoch 1), and the last one we wrote.
  std::atomic<int64_t> startEpoch_{0};
  int64_t snapshotWritten_ = 0;
  std::string joinRefusal_; // why the log ignored our join record
  struct Lease {
    int64_t beats = -1;
    std::chrono::steady_clock::time_point changed;
    bool probing = false; // a connection was opened to see if it lives
    // When it was first found stale (and kept only because it answered a
    // probe): a member reachable but renewing nothing for kMaxLeaseProbing
    // leases (its watcher lost the store, say) is declared dead anyway.
    std::optional<std::chrono::steady_clock::time_point> staleSince;
  };
  std::unordered_map<uint64_t, Lease> leases_; // by incarnation
  // Membership changes applied from the log (joins, leaves, members
  // declared dead, ourselves included), and leases found lapsed (a member
  // then probed, alive or not): get_metrics' rpc_ext.membership.*.
  std::atomic<uint64_t> joins_{0}, leaves_{0}, deaths_{0}, leaseLapses_{0};
  // Records passed over for want of the group's proof.
  std::atomic<uint64_t> unproven_{0};
  std::chrono::steady_clock::time_point nextBeat_, nextLeaseCheck_;
  // When we last renewed our lease; whether the watcher was ever held up
  // past it (our lease may have lapsed), and whether an epoch ended under a
  // lease that held was said (watcher thread, after joinLog).
  std::chrono::steady_clock::time_point lastBeat_;
  bool leaseLapsed_ = false;
  std::chrono::steady_clock::time_point lapsedAt_;
  bool epochEndSaid_ = false;
  std::thread watcher_;
  std::mutex watcherMutex_;
  // Held by startWatcher() and across stopWatcher()'s join (taken before
  // watcherMutex_).
  std::mutex watcherJoinMutex_;
  std::condition_variable watcherCv_;
  bool watcherStop_ = false;
  std::atomic<bool> fenced_{false};
  std::string fencedReason_; // written once, before fenced_
  std::atomic<bool> left_{false};
  // Our join record was applied as a join (set by the joining thread,
  // before the watcher starts; read by leave() and stop()).
  std::atomic<bool> joined_{false};

  std::mutex eventsMutex_;
  std::condition_variable eventsCv_;
  std::deque<MembershipEvent> events_;
  bool reportEvents_ = false; // from our join to our leave or death
  bool eventsClosed_ = false;
};

} // namespace torch_rpc_ext
