// SPDX-License-Identifier: BSD-3-Clause
// The dynamic group (group.h; init_rpc with world_size=None,
// docs/elastic.md): joining through the membership log, the watcher thread
// that applies the log and renews our lease (group_leases.cpp judges the
// others', and holds the waits on the log and on acknowledgements), and
// leaving.
#include <algorithm>

#include <c10/util/StringUtil.h>

#include <thread>

#include "csrc/agent/dynamic_devices.h"
#include "csrc/agent/group.h"
#include "csrc/common/logging.h"
#include "csrc/common/threads.h"

namespace torch_rpc_ext {

namespace {

using Clock = std::chrono::steady_clock;

// The watcher looks at the log this often when it changes, backing off to
// kIdlePoll while it does not.
constexpr auto kBusyPoll = std::chrono::milliseconds(20);
constexpr auto kIdlePoll = std::chrono::milliseconds(200);

} // namespace

void Group::joinLog(
    const std::string& entry,
    std::chrono::milliseconds rpcTimeout) {
  // Every record we write carries the group's proof, and we apply only
  // records that do (membership.h).
  log_ =
      std::make_unique<MembershipLog>(store_, secret_, exchange_.logPrefix());
  // A join that fails before it is applied takes back what it wrote: our
  // lease key, and our join where the store failed before we read it back
  // (members may have applied it, and would wait out our lease). Not a join
  // the group passed over: nobody applied it (a leave would spend an epoch
  // of every member's). Once joined, stop() takes back a failure.
  bool appended = false;
  bool readBack = false;
  int64_t joinedAt = 0; // where our join went, once the store said so
  try {
    joinRecorded(entry, rpcTimeout, appended, readBack, joinedAt);
  } catch (...) {
    if (joined_) {
      throw;
    }
    if (appended && !readBack) {
      recordLeave("take back its join, if the store took it", joinedAt);
    }
    try {
      log_->forget(incarnation_);
    } catch (const std::exception&) {
      // The store may be gone: nothing depends on these keys.
    }
    throw;
  }
}

void Group::joinRecorded(
    const std::string& entry,
    std::chrono::milliseconds rpcTimeout,
    bool& appended,
    bool& readBack,
    int64_t& joinedAt) {
  const auto& self = self_;
  log_->beat(incarnation_);
  // A member that died meanwhile is declared dead by its lease, which ends
  // any wait for it; this bounds the rest (a store that stopped answering).
  const auto joinTimeout = std::max<std::chrono::milliseconds>(
      rpcTimeout.count() > 0 ? rpcTimeout : options_.rendezvousTimeout,
      3 * leaseTimeout());
  auto deadline = Clock::now() + joinTimeout;
  Member me;
  me.rank = static_cast<int32_t>(self.id_);
  me.name = self.name_;
  me.incarnation = incarnation_;
  me.leaseMs = leaseTimeout().count();
  // The members learn our devices and maps from our join record (a static
  // group exchanged them before the agent existed).
  me.offers = entry.substr(std::min(entry.size(), entry.find('\n') + 1)) +
      deviceOfferLines(options_.devices, options_.deviceMaps);

  // One format in one log: a worker of another version would pass over
  // our records, and we over its, each a group of its own.
  std::string format = log_->claimFormat();
  if (format == kLogFormat) {
    // Ours is under the secret's prefix; an earlier version kept its log
    // at the root (every version before session 110 did, for a group given
    // a passphrase), beside which ours would be a second group.
    format = MembershipLog(store_).claimFormat();
  }
  TORCH_CHECK(
      format == kLogFormat,
      "init_rpc of ",
      me.name,
      " failed: the dynamic group's membership log in the store was written "
      "by another version of torch_rpc_ext (",
      format.empty() ? std::string("records without proofs")
                     : "format '" + format + "'",
      "; this version writes '",
      kLogFormat,
      "'): every member of a group runs one version");
  int64_t epoch = 0;
  {
    std::unique_lock<std::mutex> lock(rosterMutex_);
    catchUp();
    // Our rank or name may still be held: by a worker that is alive (an
    // error), or by one that died and was not declared dead yet (a
    // replacement arriving before the heartbeat noticed): we declare it
    // dead once its lease has not been renewed for the lease timeout (for
    // up to kMaxLeaseProbing more while its listener answers).
    while (true) {
      const Member* holder = roster_.byRank(me.rank);
      if (!holder) {
        holder = roster_.byName(me.name);
      }
      if (!holder) {
        break;
      }
      awaitHolderGone(*holder, me, deadline, lock);
    }
    // Our device maps and the members' must land on devices their targets
    // publish, checked before we hold anything in the log.
    const std::string conflict =
        roster_.mapConflict(me.name, parseDeviceOffer(me.offers));
    TORCH_CHECK(
        conflict.empty(),
        "init_rpc of ",
        me.name,
        " (rank ",
        me.rank,
        ") failed: ",
        conflict);
    // Our RRef and autograd ids start past every earlier holder's of this
    // rank (torch derives them from the rank alone).
    // Members pass over a record past the bound as a store writer's.
    const std::string record = joinRecord(me);
    TORCH_CHECK(
        record.size() <= kMaxRecordBytes,
        "init_rpc of ",
        me.name,
        " (rank ",
        me.rank,
        ") failed: its join record would be ",
        record.size(),
        " bytes (its devices and device maps, a line per target worker), "
        "over the membership log's bound of ",
        kMaxRecordBytes,
        " bytes");
    listener_.reserveIds(me.rank, log_->nextGeneration(me.rank));
    appended = true; // or may be: a store that took it, then failed us
    epoch = log_->append(record, roster_.epoch());
    joinedAt = epoch;
    int64_t stuck = 0;
    TORCH_CHECK(
        catchUpTo(epoch, deadline, lock, stuck),
        "init_rpc of ",
        me.name,
        " (rank ",
        me.rank,
        ") failed: its join is record ",
        epoch,
        " of the group's membership log, and record ",
        stuck,
        " reads empty in the rendezvous store although later ones are "
        "there: it was deleted or written over (by something other than a "
        "member of the group); nobody reads past it until a record fills it");
    readBack = true;
    Peer* mine = view()->find(me.rank);
    joined_ = mine && mine->incarnation == incarnation_;
    if (!joined_) {
      TORCH_CHECK(
          false,
          "init_rpc of ",
          me.name,
          " (rank ",
          me.rank,
          ") failed: ",
          joinRefusal_.empty() ? "the group did not take our join"
                               : joinRefusal_);
    }
    ackApplied();
    // Snapshots are the members' to write as they cross a multiple of
    // snapshotEvery(), not ours at the epoch we joined at (before, every
    // joiner wrote one, a copy of every join record, on its first turn).
    snapshotWritten_ = roster_.epoch();
    std::lock_guard<std::mutex> events(eventsMutex_);
    reportEvents_ = true;
  }
  // Our lease counts from our join record, which the members apply now.
  lastBeat_ = Clock::now();
  startWatcher();
  // Return once every member knows us: a member may call us as soon as our
  // init_rpc returned (upstream's test_dynamic_rpc_existing_rank_...).
  // Joined, but init_rpc fails: we leave again, then say why.
  auto abandon = [&](const std::string& why) {
    const bool leaving = !left_.exchange(true);
    if (leaving) {
      try {
        std::lock_guard<std::mutex> lock(rosterMutex_);
        log_->append(leaveRecord(incarnation_), roster_.epoch());
      } catch (const std::exception&) {
      }
    }
    stopWatcher();
    if (leaving) {
      try {
        log_->forget(incarnation_); // once no round can write them again
      } catch (const std::exception&) {
      }
    }
    TORCH_CHECK(false, "init_rpc of ", me.name, " ", why);
  };
  std::vector<std::string> missing;
  if (!awaitAcks(epoch, deadline, &missing)) {
    abandon(
        "timed out after " + secondsText(joinTimeout) + " waiting for " +
        c10::Join(", ", missing) + " to acknowledge its join");
  }
  if (!exchange_.noteJoined()) {
    abandon(
        "failed: the dynamic group started over with a new secret while we "
        "joined (nobody alive was left to seal the old one to newcomers); "
        "call init_rpc again to join the new group");
  }
}

bool Group::catchUp() {
  bool changed = false;
  if (roster_.epoch() == 0) {
    // A joiner starts from the newest snapshot, if any, not from epoch 1.
    auto [epoch, text] = log_->latestSnapshot();
    Roster from;
    if (epoch > 0 && from.restore(epoch, text)) {
      roster_ = std::move(from);
      startEpoch_ = epoch;
      for (const auto& [rank, member] : roster_.members()) {
        MembershipEvent ev;
        ev.kind = MembershipEvent::Kind::kJoin;
        ev.epoch = epoch;
        ev.member = member;
        applyEvent(ev);
      }
      changed = true;
    }
  }
  while (auto record = log_->read(roster_.epoch() + 1)) {
    if (record->proven) {
      applyEvent(roster_.apply(record->body));
    } else if (record->oversized > 0) {
      // Over the bound (a joiner's refuses to write one): a store writer's.
      const std::string why = "the record at epoch " +
          std::to_string(roster_.epoch() + 1) + " is " +
          std::to_string(record->oversized) + " bytes, over the log's bound (" +
          std::to_string(kMaxRecordBytes) + " and its proof)";
      if (unproven_.fetch_add(1, std::memory_order_relaxed) == 0) {
        logWarning(
            "torch_rpc_ext: " + self_.name_ +
            " passes over a membership "
            "record: " +
            why +
            "; rpc_ext.membership.unproven_records counts "
            "such records");
      }
      applyEvent(roster_.skip(why));
    } else {
      // Written by someone without the group's secret: a store writer's
      // forgery, or a record of the group this store held before it
      // started over with a new secret. Every member passes it over alike.
      const int64_t epoch = roster_.epoch() + 1;
      if (unproven_.fetch_add(1, std::memory_order_relaxed) == 0) {
        logWarning(
            "torch_rpc_ext: " + self_.name_ +
            " passes over the membership record at epoch " +
            std::to_string(epoch) +
            ": it does not carry the group's proof (written without the "
            "group's secret: a forgery, or a record of an earlier group in "
            "this store); rpc_ext.membership.unproven_records counts them");
      }
      applyEvent(roster_.skip(
          "the record at epoch " + std::to_string(epoch) +
          " does not carry the group's proof"));
    }
    changed = true;
  }
  return changed;
}

void Group::fence(const std::string& reason) {
  if (fenced_.load()) {
    return;
  }
  // Fenced: the others no longer talk to us, nor we to them.
  fencedReason_ = reason;
  fenced_ = true;
  logWarning("torch_rpc_ext: " + fencedReason_);
  listener_.onFenced(fencedReason_);
}

void Group::applyEvent(const MembershipEvent& ev) {
  auto old = view();
  auto next = std::make_shared<View>(*old);
  next->epoch = ev.epoch;
  const std::string epochText = " at epoch " + std::to_string(ev.epoch);
  switch (ev.kind) {
    case MembershipEvent::Kind::kIgnored:
      if (ev.member.incarnation == incarnation_) {
        joinRefusal_ = ev.reason;
      }
      break;
    case MembershipEvent::Kind::kJoin: {
      joins_.fetch_add(1, std::memory_order_relaxed);
      Route route;
      try {
        route = listener_.routeFor(ev.member.name, ev.member.offers);
      } catch (const std::exception& e) {
        route.unreachable = e.what(); // calls to it fail with this
      }
      auto peer = adopt(
          rpc::WorkerInfo(ev.member.name, static_cast<int64_t>(ev.member.rank)),
          ev.member.incarnation,
          std::move(route));
      if (next->byId.size() <= static_cast<size_t>(ev.member.rank)) {
        next->byId.resize(static_cast<size_t>(ev.member.rank) + 1);
      }
      next->byId[static_cast<size_t>(ev.member.rank)] = peer;
      next->byName[ev.member.name] = peer;
      break;
    }
    case MembershipEvent::Kind::kLeave:
    case MembershipEvent::Kind::kDead: {
      (ev.kind == MembershipEvent::Kind::kLeave ? leaves_ : deaths_)
          .fetch_add(1, std::memory_order_relaxed);
      std::shared_ptr<Peer> peer;
      if (Peer* p = old->find(ev.member.rank);
          p && p->incarnation == ev.member.incarnation) {
        peer = old->byId[static_cast<size_t>(ev.member.rank)];
      }
      const std::string why = ev.kind == MembershipEvent::Kind::kLeave
          ? ev.member.name + " left the group" + epochText
          : ev.member.name + " was declared dead" + epochText + ": " +
              ev.reason;
      next->byId[static_cast<size_t>(ev.member.rank)].reset();
      next->byName.erase(ev.member.name);
      leases_.erase(ev.member.incarnation);
      if (ev.member.incarnation == incarnation_) {
        if (ev.kind == MembershipEvent::Kind::kDead && !left_.load()) {
          fence(
              "this worker (" + ev.member.name +
              ") was declared dead by the group" + epochText + ": " +
              ev.reason);
        }
        break;
      }
      if (!peer) {
        break;
      }
      // Departed first, then its connections closed (connectionTo opens
      // none to a departed peer) and what it left in torch's RRef state
      // dropped, before we acknowledge the departure.
      peer->depart(why, ev.kind == MembershipEvent::Kind::kDead);
      listener_.onDeparted(*peer, ev.kind == MembershipEvent::Kind::kDead);
      break;
    }
  }
  publish(std::move(next));
  if (ev.kind != MembershipEvent::Kind::kIgnored) {
    std::lock_guard<std::mutex> lock(eventsMutex_);
    if (reportEvents_) {
      events_.push_back(ev);
      // Our own leave (or death) is the last change we report: we are no
      // longer a member of what follows.
      if ((ev.kind == MembershipEvent::Kind::kLeave ||
           ev.kind == MembershipEvent::Kind::kDead) &&
          ev.member.incarnation == incarnation_) {
        reportEvents_ = false;
      }
      eventsCv_.notify_all();
    }
  }
}

void Group::watch() {
  auto pause = kBusyPoll;
  std::string lastError;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(watcherMutex_);
      if (watcherCv_.wait_for(lock, pause, [this] { return watcherStop_; })) {
        return;
      }
    }
    try {
      auto now = Clock::now();
      if (now >= nextBeat_) {
        // A watcher held up past our lease (a stopped process, a starved
        // one): the others may have counted us gone meanwhile.
        if (now - lastBeat_ > leaseTimeout()) {
          leaseLapsed_ = true;
          lapsedAt_ = now;
        }
        log_->beat(incarnation_);
        lastBeat_ = now;
        nextBeat_ = now + leaseTimeout() / 5;
      }
      bool changed;
      {
        std::lock_guard<std::mutex> lock(rosterMutex_);
        changed = catchUp();
        ackApplied();
        // Every snapshotEvery() epochs, the roster as a snapshot for joiners.
        const int64_t every = MembershipLog::snapshotEvery();
        if (roster_.epoch() / every > snapshotWritten_ / every &&
            !fenced_.load()) {
          log_->writeSnapshot(roster_.epoch(), roster_.snapshot());
          snapshotWritten_ = roster_.epoch();
        }
        if (now >= nextLeaseCheck_ && !fenced_.load()) {
          checkLeases();
          ackApplied(); // a death it recorded itself
          checkOurEpoch(now);
          nextLeaseCheck_ = now +
              std::min<std::chrono::milliseconds>(
                                leaseTimeout() / 5, std::chrono::seconds(1));
        }
      }
      const bool exchanging = exchange_.serve(secret_);
      pause =
          changed || exchanging ? kBusyPoll : std::min(pause * 2, kIdlePoll);
      lastError.clear();
    } catch (const std::exception& e) {
      // The store is unreachable (its host exited, say): say so once per
      // new error, keep trying.
      if (lastError != e.what()) {
        lastError = e.what();
        logWarning(
            "torch_rpc_ext: " + self_.name_ +
            " cannot read the group's membership from the store: " + lastError);
      }
      pause = kIdlePoll;
    }
  }
}

void Group::leave(std::optional<Clock::time_point> deadline) {
  if (!joined_ || left_.exchange(true)) {
    return;
  }
  int64_t epoch;
  {
    std::unique_lock<std::mutex> lock(rosterMutex_);
    catchUp();
    epoch = log_->append(leaveRecord(incarnation_), roster_.epoch());
    auto readUntil = Clock::now() + 2 * leaseTimeout();
    if (deadline && *deadline < readUntil) {
      readUntil = *deadline;
    }
    int64_t stuck = 0;
    if (!catchUpTo(epoch, readUntil, lock, stuck)) {
      logWarning(
          "torch_rpc_ext: " + self_.name_ + " leaves the group as record " +
          std::to_string(epoch) + " of its membership log, and record " +
          std::to_string(stuck) +
          " reads empty in the rendezvous store although later ones are "
          "there: it was deleted or written over, and nobody reads past "
          "it to our leave until a record fills it");
    }
  }
  // Once every member has applied our leave, nobody starts a call to us;
  // then the calls we are serving finish (their responses still go out).
  auto until = Clock::now() + 2 * leaseTimeout();
  if (deadline && *deadline < until) {
    until = *deadline;
  }
  std::vector<std::string> missing;
  if (!awaitAcks(epoch, until, &missing)) {
    logWarning(
        "torch_rpc_ext: " + self_.name_ + " leaves before " +
        c10::Join(", ", missing) + " acknowledged it");
  }
  auto pause = std::chrono::milliseconds(1);
  while (listener_.callsBeingServed() > 0 && Clock::now() < until) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kBusyPoll);
  }
  stopWatcher();
  try {
    log_->forget(incarnation_);
  } catch (const std::exception&) {
    // The store may be gone already: nothing depends on these keys.
  }
}

void Group::stop() {
  // Only a member records a leave: an init_rpc that failed before its join
  // was applied took back what it wrote itself (joinLog), and a leave of a
  // join the group passed over would spend an epoch of every member's.
  if (!joined_ || left_.exchange(true)) {
    stopWatcher();
    return;
  }
  // Not a graceful leave (shutdown(graceful=False), or an error): tell the
  // group at once rather than let our lease run out.
  recordLeave("record leaving the group");
  // Then our keys, once no round of the watcher can write them again.
  stopWatcher();
  try {
    log_->forget(incarnation_);
  } catch (const std::exception&) {
    // The store may be gone already: nothing depends on these keys.
  }
}

void Group::startWatcher() {
  std::lock_guard<std::mutex> starting(watcherJoinMutex_); // not in a stop
  std::lock_guard<std::mutex> lock(watcherMutex_);
  if (watcher_.joinable()) {
    return;
  }
  watcherStop_ = false;
  {
    std::lock_guard<std::mutex> events(eventsMutex_);
    eventsClosed_ = false;
  }
  watcher_ = std::thread([this] {
    nameThisThread("rpcx-group");
    watch();
  });
}

void Group::stopWatcher() {
  {
    std::lock_guard<std::mutex> lock(eventsMutex_);
    eventsClosed_ = true;
  }
  eventsCv_.notify_all();
  {
    std::lock_guard<std::mutex> lock(watcherMutex_);
    watcherStop_ = true;
    if (watcher_.get_id() == std::this_thread::get_id()) {
      return; // from the watcher itself: it stops after this round
    }
  }
  watcherCv_.notify_all();
  // Held across the join: a second caller returns only once the thread is
  // gone (a leave then forgets our lease keys, which a running watcher
  // would write again; ~Group frees what it reads).
  std::lock_guard<std::mutex> joining(watcherJoinMutex_);
  std::thread watcher;
  {
    std::lock_guard<std::mutex> lock(watcherMutex_);
    watcher = std::move(watcher_);
  }
  if (watcher.joinable()) {
    watcher.join();
  }
}

std::optional<std::vector<MembershipEvent>> Group::takeEvents(
    std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(eventsMutex_);
  eventsCv_.wait_for(
      lock, timeout, [this] { return eventsClosed_ || !events_.empty(); });
  if (events_.empty() && eventsClosed_) {
    return std::nullopt;
  }
  std::vector<MembershipEvent> out(events_.begin(), events_.end());
  events_.clear();
  return out;
}

void Group::recordLeave(const std::string& what, int64_t after) {
  try {
    std::lock_guard<std::mutex> lock(rosterMutex_);
    log_->append(leaveRecord(incarnation_), std::max(roster_.epoch(), after));
  } catch (const std::exception& e) {
    logWarning(
        "torch_rpc_ext: " + self_.name_ + " could not " + what +
        " (its lease will run out): " + e.what());
  }
}

} // namespace torch_rpc_ext
