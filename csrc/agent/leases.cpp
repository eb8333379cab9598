// SPDX-License-Identifier: BSD-3-Clause
// Whether the members of a dynamic group are alive (docs/elastic.md,
// "Leases"): each renews a lease in the store; the others watch it, probe a
// member whose lease lapsed over the transport, and declare dead one they
// cannot reach.
#include "csrc/agent/agent.h"

namespace torch_rpc_ext {

namespace {

using Clock = std::chrono::steady_clock;

// How many leases a member reachable on the transport may go without
// renewing its own before it is declared dead all the same.
constexpr int kMaxLeaseProbing = 3;

} // namespace

std::chrono::milliseconds Agent::leaseTimeout() const {
  return options_.heartbeatTimeout.count() > 0 ? options_.heartbeatTimeout
                                               : kDefaultHeartbeatTimeout;
}

void Agent::checkLeases() {
  const auto now = Clock::now();
  std::vector<Member> stale;
  for (const auto& [rank, m] : roster_.members()) {
    if (m.incarnation == incarnation_) {
      continue;
    }
    int64_t beats = log_->beats(m.incarnation);
    auto [it, fresh] = leases_.try_emplace(m.incarnation, Lease{beats, now});
    if (fresh || it->second.beats != beats) {
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
                " (seen by " + workerInfo_.name_ + ")"),
        roster_.epoch());
    catchUp();
  }
}

bool Agent::reachable(const Member& m) {
  auto v = view();
  Peer* peer = v->find(m.rank);
  if (!peer || peer->incarnation != m.incarnation) {
    return false;
  }
  std::shared_ptr<transport::Connection> conn;
  try {
    conn = connectionTo(*peer);
  } catch (const std::exception&) {
    return false;
  }
  if (conn->isReady() && !conn->isClosed()) {
    return true;
  }
  // Still connecting: one more lease check to finish its handshake.
  auto& lease = leases_[m.incarnation];
  if (!conn->isClosed() && !lease.probing) {
    lease.probing = true;
    return true;
  }
  return false;
}

} // namespace torch_rpc_ext
