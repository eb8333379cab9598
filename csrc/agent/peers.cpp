// SPDX-License-Identifier: BSD-3-Clause
// Who the agent talks to: worker lookups by name and id (with the reason a
// departed worker is gone), the membership view and the peers behind it
// (membership.h), the connection to each peer, and connections arriving
// and going.
#include <c10/util/StringUtil.h>

#include "csrc/agent/agent.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

const rpc::WorkerInfo& Agent::getWorkerInfo(
    const std::string& workerName) const {
  auto v = view();
  auto it = v->byName.find(workerName);
  if (it != v->byName.end()) {
    return it->second->info; // peers live as long as we do
  }
  std::string why;
  if (auto gone = lastPeerNamed(workerName)) {
    why = ": " + gone->departure();
  } else {
    std::vector<std::string> names;
    for (const auto& p : v->byId) {
      if (p) {
        names.push_back(p->info.name_);
      }
    }
    why = " (known workers: " + c10::Join(", ", names) + ")";
  }
  TORCH_CHECK(
      false,
      "name:",
      workerInfo_.name_,
      ",rank:",
      workerInfo_.id_,
      " could not find destination name ",
      workerName,
      why);
}

const rpc::WorkerInfo& Agent::getWorkerInfo(rpc::worker_id_t id) const {
  auto v = view();
  if (Peer* p = v->find(id)) {
    return p->info;
  }
  std::string why = worldSize_ > 0
      ? " (world size " + std::to_string(worldSize_) + ")"
      : " (no member holds it at epoch " + std::to_string(v->epoch) + ")";
  {
    std::lock_guard<std::mutex> lock(peersMutex_);
    for (auto it = peers_.rbegin(); it != peers_.rend(); ++it) {
      if ((*it)->info.id_ == id && (*it)->departed()) {
        why = ": " + (*it)->departure();
        break;
      }
    }
  }
  TORCH_CHECK(
      false,
      "name:",
      workerInfo_.name_,
      ",rank:",
      workerInfo_.id_,
      " could not find destination id ",
      id,
      why);
}

std::vector<rpc::WorkerInfo> Agent::getWorkerInfos() const {
  return view()->infos();
}

void Agent::publish(std::shared_ptr<const View> view) {
  std::lock_guard<std::mutex> lock(viewMutex_);
  view_ = std::move(view);
}

Peer* Agent::peerById(int64_t id) const {
  std::lock_guard<std::mutex> lock(viewMutex_);
  return view_->find(id);
}

Peer* Agent::memberOn(const transport::Connection& conn) const {
  // The id's current holder, if it is who authenticated on `conn`.
  Peer* p = peerById(conn.peerId());
  return p && p->incarnation == conn.peerIncarnation() ? p : nullptr;
}

std::shared_ptr<Peer> Agent::lastPeerNamed(const std::string& name) const {
  std::lock_guard<std::mutex> lock(peersMutex_);
  for (auto it = peers_.rbegin(); it != peers_.rend(); ++it) {
    if ((*it)->info.name_ == name) {
      return *it;
    }
  }
  return nullptr;
}

std::shared_ptr<Peer> Agent::adopt(
    rpc::WorkerInfo info,
    uint64_t incarnation,
    Route route) {
  auto peer =
      std::make_shared<Peer>(std::move(info), incarnation, std::move(route));
  std::lock_guard<std::mutex> lock(peersMutex_);
  peers_.push_back(peer);
  return peer;
}

std::shared_ptr<transport::Connection> Agent::connectionTo(const Peer& peer) {
  std::lock_guard<std::mutex> lock(connMutex_);
  // A departing peer's connection is closed under this lock after it is
  // marked departed (elastic.cpp), so none is opened to it afterwards.
  TORCH_CHECK(
      !peer.departed(),
      "RPC to ",
      peer.info.name_,
      " failed: ",
      peer.departure());
  TORCH_CHECK(
      peer.route.unreachable.empty(),
      "RPC to ",
      peer.info.name_,
      " failed: ",
      peer.route.unreachable);
  auto& slot = outbound_[&peer];
  if (!slot || slot->isClosed()) {
    const Route& route = peer.route;
    slot = transports_.at(route.transport)
               ->connect(route.address, peer.info.id_, this);
  }
  return slot;
}

void Agent::onReady(const std::shared_ptr<transport::Connection>& conn) {
  if (conn->isOutbound()) {
    return;
  }
  // Ids the handshake admitted (it knew the secret) but no member holds:
  // a departed worker's process, or one whose join we have not applied.
  if (Peer* p = memberOn(*conn); !p || p->departed()) {
    conn->close(
        "worker id " + std::to_string(conn->peerId()) +
        " is not a member of the group at epoch " +
        std::to_string(view()->epoch));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(connMutex_);
    // Departures sweep inbound_ under this lock after marking the peer: one
    // that departed meanwhile is refused below (outside the lock: closing on
    // the loop thread reports onClosed, which takes it), not left open.
    if (Peer* p = memberOn(*conn); p && !p->departed()) {
      inbound_.emplace(conn->peerId(), conn);
      return;
    }
  }
  conn->close("worker id " + std::to_string(conn->peerId()) + " departed");
}

void Agent::onClosed(transport::Connection& conn, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(connMutex_);
    for (auto it = outbound_.begin(); it != outbound_.end(); ++it) {
      if (it->second.get() == &conn) {
        outbound_.erase(it);
        break;
      }
    }
    auto range = inbound_.equal_range(conn.peerId());
    for (auto it = range.first; it != range.second;) {
      auto held = it->second.lock();
      it = !held || held.get() == &conn ? inbound_.erase(it) : std::next(it);
    }
  }
  if (conn.rejectedPeer()) {
    if (Peer* p = memberOn(conn)) {
      p->stats.rejectedFrames.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (!conn.isOutbound() && conn.peerId() < 0 && !reason.empty()) {
    rejectedConnections_.fetch_add(1, std::memory_order_relaxed);
    logWarning(
        "torch_rpc_ext: " + workerInfo_.name_ + " refused connection " +
        conn.describe() + ": " + reason);
  }
  auto failed = calls_.takeConnection(&conn);
  if (failed.empty()) {
    // A peer's connection we closed because it broke the protocol is worth
    // a line even with no call of ours on it.
    if (!conn.isOutbound() && conn.peerId() >= 0 && !shuttingDown_.load() &&
        conn.rejectedPeer()) {
      logWarning(
          "torch_rpc_ext: " + workerInfo_.name_ + " closed connection " +
          conn.describe() + ": " + reason);
    }
    return;
  }
  if (!shuttingDown_.load()) {
    logWarning(
        "torch_rpc_ext: " + workerInfo_.name_ + " lost connection " +
        conn.describe() + " with " + std::to_string(failed.size()) +
        " calls pending: " + reason);
  }
  const Peer* peer = failed.front().second.peer;
  std::string why = reason.empty() ? "RPC agent is shutting down" : reason;
  for (auto& [id, call] : failed) {
    call.peer->stats.errors.fetch_add(1, std::memory_order_relaxed);
    settleWithError(
        std::move(call),
        "RPC to " + peer->info.name_ + " failed: connection " +
            conn.describe() + " lost: " + why);
  }
}

} // namespace torch_rpc_ext
