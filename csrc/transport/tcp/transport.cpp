// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/transport.h"

#include <stdexcept>

#include "csrc/transport/tcp/connection.h"
#include "csrc/transport/tcp/listener.h"

namespace torch_rpc_ext::transport::tcp {

TcpTransport::TcpTransport(TransportOptions options, bool shm)
    : options_(std::move(options)), shm_(shm), loop_(options_.busyPoll) {}

std::map<std::string, uint64_t> TcpTransport::counters() const {
  std::map<std::string, uint64_t> c{
      {"loop_takeovers", loop_.takeovers()},
      {"busy_poll_hits", loop_.spinHits()},
      {"busy_poll_misses", loop_.spinMisses()},
  };
  if (shm_) {
    const auto& s = loop_.slabCounters();
    c["shm_slab_segments"] = s.segments.load();
    c["shm_slab_copied_bytes"] = s.copiedBytes.load();
    c["shm_slab_handbacks"] = s.handedBack.load();
    c["shm_slabs_created"] = s.created.load();
    c["shm_slabs_unmapped"] = s.unmapped.load();
    c["shm_slab_fallbacks"] = s.fallbacks.load();
  }
  return c;
}

TcpTransport::~TcpTransport() {
  stop();
}

std::shared_ptr<Listener> TcpTransport::listen() {
  auto l = std::make_shared<TcpListener>(*this);
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_.push_back(l);
  return l;
}

std::shared_ptr<Connection> TcpTransport::connect(
    const std::string& address,
    int32_t expectedPeerId,
    ConnectionObserver* observer) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) {
      throw std::runtime_error("transport is stopped");
    }
  }
  auto conn = TcpConnection::connect(
      loop_, options_, address, expectedPeerId, observer, shm_);
  adopt(conn);
  return conn;
}

void TcpTransport::adopt(const std::shared_ptr<Connection>& conn) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopped_) {
    conn->close("");
    return;
  }
  // Forget connections that are gone so the list stays the size of the
  // live set.
  if (connections_.size() >= 64 && (connections_.size() & 63) == 0) {
    std::erase_if(connections_, [](const auto& w) {
      auto c = w.lock();
      return !c || c->isClosed();
    });
  }
  connections_.push_back(conn);
}

void TcpTransport::stop() {
  std::vector<std::weak_ptr<Connection>> conns;
  std::vector<std::shared_ptr<Listener>> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) {
      return;
    }
    stopped_ = true;
    conns.swap(connections_);
    listeners.swap(listeners_);
  }
  for (auto& l : listeners) {
    l->close();
  }
  for (auto& w : conns) {
    if (auto c = w.lock()) {
      c->close("");
    }
  }
  loop_.stop();
}

} // namespace torch_rpc_ext::transport::tcp
