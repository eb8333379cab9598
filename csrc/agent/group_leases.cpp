// SPDX-License-Identifier: BSD-3-Clause
// Whether the members of a dynamic group are alive (docs/elastic.md,
// "Leases"): each renews a lease in the store; the others watch it, probe a
// member whose lease lapsed over the transport, and declare dead one they
// cannot reach. Each acknowledges the epoch it applied, which joiners and
// leavers wait for. And the joiner's and leaver's other waits on the log:
// for the holder of its rank or name to go, for the log to reach its record.
#include <algorithm>
#include <thread>

#include "csrc/agent/group.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

namespace {

using Clock = std::chrono::steady_clock;

} // namespace

std::chrono::milliseconds Group::leaseTimeout() const {
  return options_.heartbeatTimeout.count() > 0 ? options_.heartbeatTimeout
                                               : kDefaultHeartbeatTimeout;
}

void Group::checkLeases() {
  const auto now = Clock::now();
  std::vector<Member> stale;
  for (const auto& [rank, m] : roster_.members()) {
    if (m.incarnation == incarnation_) {
      continue;
    }
    int64_t beats = log_->beats(m.incarnation);
    auto [it, fresh] = leases_.try_emplace(m.incarnation, Lease{beats, now});
    // Renewed: its proven counter grew (a replayed older one is no sign).
    if (fresh || beats > it->second.beats) {
      it->second = Lease{beats, now, false};
    } else if (
        now - it->second.changed > std::chrono::milliseconds(m.leaseMs)) {
      stale.push_back(m);
    }
  }
  for (const auto& m : stale) {
    if (!roster_.byIncarnation(m.incarnation)) {
      continue; // declared by the record just applied
    }
    // A lease can lapse while its holder lives: the store is slow, or the
    // host too busy to run the holder's watcher in time. The transport
    // tells better: a ready connection to it would have been closed by its
    // heartbeat had the holder gone quiet. So a stale lease makes us probe;
    // only a holder we cannot reach (refused, reset, or no handshake by the
    // next check) is declared dead.
    auto& lease = leases_[m.incarnation];
    if (!lease.staleSince) {
      lease.staleSince = now;
      leaseLapses_.fetch_add(1, std::memory_order_relaxed);
    }
    if (now - *lease.staleSince <
            kMaxLeaseProbing * std::chrono::milliseconds(m.leaseMs) &&
        reachable(m)) {
      lease.changed = now;
      continue;
    }
    log_->append(
        deadRecord(
            m.incarnation,
            incarnation_,
            "its lease was not renewed for " +
                secondsText(std::chrono::milliseconds(m.leaseMs)) +
                " (seen by " + self_.name_ + ")"),
        roster_.epoch());
    catchUp();
  }
}

void Group::checkOurEpoch(Clock::time_point now) {
  if (left_.load()) {
    return;
  }
  const bool ended = exchange_.epochEnded();
  // A lapse the group had time to act on and did not (no start-over within
  // a joiner's longest wait: a lease, then three of knocks) is forgotten:
  // an epoch end after that is not its doing.
  if (leaseLapsed_ && !ended &&
      now - lapsedAt_ >
          (1 + kMaxLeaseProbing) * leaseTimeout() + std::chrono::seconds(1)) {
    leaseLapsed_ = false;
  }
  if (!ended) {
    return;
  }
  // A group whose members all lapsed, we among them (our process stopped,
  // say), starts over with a new secret and a log of its own, where nobody
  // would declare us dead. We are out, and say so. An epoch ended while
  // our lease held (a joiner that saw none of us alive, or a writer of the
  // store) is not ours to obey: said once, and we go on.
  if (leaseLapsed_) {
    fence(
        "this worker (" + self_.name_ +
        ") is no longer in the group: the group started over with a new "
        "secret while this worker's lease had lapsed (nobody was seen alive "
        "to seal the old one to a joiner)");
  } else if (!epochEndSaid_) {
    epochEndSaid_ = true;
    logWarning(
        "torch_rpc_ext: " + self_.name_ +
        ": the group's secret epoch was ended while this worker's lease "
        "held (a joiner saw no member alive, or someone wrote the store): "
        "joiners from now on start a group of their own with another "
        "secret, and this one goes on without them");
  }
}

void Group::ackApplied() {
  // Everything applied is acknowledged, however it was applied (by this
  // loop, by join or leave, by a lease check): a joiner waits for it.
  if (roster_.epoch() > ackedEpoch_) {
    log_->ack(incarnation_, roster_.epoch());
    ackedEpoch_ = roster_.epoch();
  }
}

bool Group::awaitAcks(
    int64_t epoch,
    Clock::time_point deadline,
    std::vector<std::string>* missing) {
  auto pause = std::chrono::milliseconds(2);
  while (true) {
    missing->clear();
    auto v = view(); // held: a range-for does not keep a temporary alive
    for (const auto& peer : v->byId) {
      if (peer && peer->incarnation != incarnation_ &&
          log_->acked(peer->incarnation) < epoch) {
        missing->push_back(peer->info.name_);
      }
    }
    if (missing->empty()) {
      return true;
    }
    if (Clock::now() >= deadline) {
      return false;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(40));
  }
}

bool Group::reachable(const Member& m) {
  auto v = view();
  Peer* peer = v->find(m.rank);
  if (!peer || peer->incarnation != m.incarnation) {
    return false;
  }
  switch (listener_.probe(*peer)) {
    case GroupListener::Probe::kReady:
      return true;
    case GroupListener::Probe::kConnecting: {
      // One more lease check to finish its handshake.
      auto& lease = leases_[m.incarnation];
      if (!lease.probing) {
        lease.probing = true;
        return true;
      }
      return false;
    }
    case GroupListener::Probe::kUnreachable:
      break;
  }
  return false;
}

void Group::awaitHolderGone(
    Member held,
    const Member& me,
    Clock::time_point& deadline,
    std::unique_lock<std::mutex>& lock) {
  const std::string what = held.rank == me.rank
      ? "rank " + std::to_string(me.rank)
      : "name " + me.name;
  const std::chrono::milliseconds lease(held.leaseMs);
  const int64_t beats = log_->beats(held.incarnation);
  // Time enough to judge it as a member would (below).
  deadline = std::max(deadline, Clock::now() + (kMaxLeaseProbing + 2) * lease);
  auto quietSince = Clock::now();
  int probes = 0;
  while (roster_.byIncarnation(held.incarnation)) {
    if (Clock::now() - quietSince >= lease) {
      // Its lease lapsed. As a member would (checkLeases), give a holder
      // that still answers (its listener accepts: a live process, perhaps
      // stalled) up to kMaxLeaseProbing more leases; we cannot probe it
      // with a handshake, which it refuses to a non-member.
      if (probes >= kMaxLeaseProbing) {
        break;
      }
      lock.unlock(); // a probe may take a second
      const bool answers =
          listener_.listenerAnswers(held.name, held.offers, lease);
      lock.lock();
      if (!answers) {
        break;
      }
      ++probes;
      quietSince = Clock::now();
    }
    TORCH_CHECK(
        Clock::now() < deadline,
        "init_rpc of ",
        me.name,
        " timed out: ",
        what,
        " is still held by ",
        held.name);
    lock.unlock();
    std::this_thread::sleep_for(lease / 10);
    lock.lock();
    catchUp();
    if (!roster_.byIncarnation(held.incarnation)) {
      return; // it left meanwhile, or a member declared it dead
    }
    TORCH_CHECK(
        log_->beats(held.incarnation) <= beats,
        "init_rpc of ",
        me.name,
        " (rank ",
        me.rank,
        "): ",
        what,
        " is held by ",
        held.name,
        " (rank ",
        held.rank,
        "), which is alive; a worker name and rank are reusable once "
        "their holder has left or died");
  }
  if (!roster_.byIncarnation(held.incarnation)) {
    return;
  }
  log_->append(
      deadRecord(
          held.incarnation,
          incarnation_,
          "its lease was not renewed for " + secondsText((probes + 1) * lease) +
              (probes > 0 ? " (its listener still answered)" : "") +
              " (seen by " + me.name + ", which takes its " + what + ")"),
      roster_.epoch());
  catchUp();
}

bool Group::catchUpTo(
    int64_t epoch,
    Clock::time_point deadline,
    std::unique_lock<std::mutex>& lock,
    int64_t& stuck) {
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    const int64_t before = roster_.epoch();
    catchUp();
    if (roster_.epoch() >= epoch) {
      return true;
    }
    if (roster_.epoch() > before) {
      pause = std::chrono::milliseconds(1);
      continue;
    }
    // A slot before ours reads empty. Before, this loop read it again at
    // once, for ever, holding the roster (the watcher, and our leave or
    // init_rpc with it): a slot that a store writer deleted, or set to the
    // very text a read tells an empty slot by (store_bytes.h: peekKey).
    stuck = roster_.epoch() + 1;
    if (Clock::now() >= deadline) {
      return false;
    }
    lock.unlock();
    std::this_thread::sleep_for(pause);
    lock.lock();
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

} // namespace torch_rpc_ext
