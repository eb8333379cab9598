// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/stream/transport.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <unordered_map>

#include "csrc/transport/stream/address.h"
#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

StreamTransport::StreamTransport(
    TransportOptions options,
    const std::string& threadName)
    : options_(std::move(options)),
      loop_(options_.busyPoll, threadName, options_.followCaller) {
  strikes_->exempt(options_.holdOffExempt);
}

StreamTransport::~StreamTransport() {
  stop();
}

std::map<std::string, uint64_t> StreamTransport::counters() const {
  std::map<std::string, uint64_t> c{
      {"loop_takeovers", loop_.takeovers()},
      {"loop_handoffs", loop_.handOffs()},
      {"busy_poll_hits", loop_.spinHits()},
      {"busy_poll_misses", loop_.spinMisses()},
      {"polls_on_caller_cpu", loop_.pollsOnCallerCpu()},
      {"poll_moves", loop_.pollMoves()},
      {"unauthenticated_closed", unauthenticatedClosed_.load()},
      {"sources_held_off", strikes_->sourcesHeldOff()},
      {"connections_held_off", strikes_->refused()},
      {"hold_off_exempt_failures", strikes_->exemptFailures()},
      {"servers_held_off", serverStrikes_->sourcesHeldOff()},
      {"dials_held_off", serverStrikes_->refused()},
      {"frames_sent", loop_.io().frames.load(std::memory_order_relaxed)},
      {"control_frames_sent",
       loop_.io().controlFrames.load(std::memory_order_relaxed)},
      {"socket_writes", loop_.io().writes.load(std::memory_order_relaxed)},
      {"socket_bytes_written",
       loop_.io().bytesWritten.load(std::memory_order_relaxed)},
      {"socket_reads", loop_.io().reads.load(std::memory_order_relaxed)},
      {"loop_wakes", loop_.io().wakes.load(std::memory_order_relaxed)},
      {"frame_ring_writes",
       loop_.io().ringWrites.load(std::memory_order_relaxed)},
      {"frame_ring_bytes_written",
       loop_.io().ringBytes.load(std::memory_order_relaxed)},
      {"frame_ring_reads",
       loop_.io().ringReads.load(std::memory_order_relaxed)},
      {"frame_ring_signals",
       loop_.io().ringSignals.load(std::memory_order_relaxed)},
      {"frame_ring_socket_bodies",
       loop_.io().ringSocketBodies.load(std::memory_order_relaxed)},
      {"heartbeat_timeouts",
       loop_.io().heartbeatTimeouts.load(std::memory_order_relaxed)},
      {"held_socket_ends",
       loop_.io().heldSocketEnds.load(std::memory_order_relaxed)},
  };
  addCounters(c);
  return c;
}

void StreamTransport::adoptListener(const std::shared_ptr<Listener>& listener) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopped_) {
    throw std::runtime_error("transport is stopped");
  }
  listeners_.push_back(listener);
}

std::shared_ptr<Connection> StreamTransport::connect(
    const std::string& address,
    int32_t expectedPeerId,
    ConnectionObserver* observer) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) {
      throw std::runtime_error("transport is stopped");
    }
  }
  std::string target = address;
  std::string refused;
  try {
    target = routeTo(address);
  } catch (const std::exception& e) {
    refused = e.what();
  }
  // A server that ended our TLS handshakes unfinished too often lately,
  // after our key exchange, is not dialed for a while: each such connection
  // told whoever runs it whether a guess at the secret was right (an
  // impostor a store writer sent us to), and with a different secret the
  // next would end the same. (A dial already under way is checked again
  // before its binder goes out: StreamConnection::exchangeFromLoop().)
  if (refused.empty() && serverStrikes_->heldOff(target)) {
    refused = StreamConnection::heldOffServerText(*serverStrikes_, target);
  }
  int family = AF_INET;
  try {
    family = SocketAddress::parse(target).family();
  } catch (const std::exception&) {
    // startConnect() reports the malformed address as the close reason.
  }
  int fd = ::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  auto conn =
      newConnection(fd, /*outbound=*/true, expectedPeerId, target, observer);
  conn->countGuessesAgainst(serverStrikes_, target);
  // Started (its channels opened) before stop() can see it: adopt() closes
  // it if the transport stopped meanwhile.
  conn->startConnect(target, refused);
  adopt(conn);
  return conn;
}

namespace {

// Whether a connect's error says the peer's end is gone: nothing listens
// there (refused, reset), or its host is not on the network. Errors of
// this host's own (ports or buffers exhausted, a firewall's EPERM, EINTR)
// say nothing of the peer. (A live listener with a full backlog under
// tcp_abort_on_overflow=1 resets too: that sysctl is off by default.)
bool peerGone(int error) {
  switch (error) {
    case ECONNREFUSED:
    case ECONNRESET:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case EHOSTDOWN:
      return true;
    default:
      return false;
  }
}

} // namespace

bool StreamTransport::listenerAnswers(
    const std::string& address,
    std::chrono::milliseconds timeout) const {
  return knock({address}, timeout).front().outcome == Knock::kAccepted;
}

std::vector<Transport::Knock> StreamTransport::knock(
    const std::vector<std::string>& addresses,
    std::chrono::milliseconds timeout) const {
  // Every connect is started at once, then all are polled together until
  // `timeout`.
  std::vector<Knock> out(addresses.size(), Knock{Knock::kUnknown, {}});
  std::vector<std::string> targets(addresses.size());
  std::vector<pollfd> waiting;
  std::vector<size_t> waitingFor;
  auto settle = [&](size_t i, int error) {
    if (error == 0) {
      out[i] = {Knock::kAccepted, {}};
    } else if (peerGone(error)) {
      out[i] = {
          Knock::kRefused,
          "connect to " + targets[i] + " failed: " + std::strerror(error)};
    }
  };
  for (size_t i = 0; i < addresses.size(); ++i) {
    SocketAddress to;
    try {
      targets[i] = routeTo(addresses[i]);
      to = SocketAddress::parse(targets[i]);
    } catch (const std::exception& e) {
      out[i] = {Knock::kRefused, e.what()}; // as connect() would close
      continue;
    }
    int fd =
        ::socket(to.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      continue; // our descriptors, not the peer: nothing known
    }
    if (::connect(
            fd, reinterpret_cast<const sockaddr*>(&to.storage), to.length) ==
        0) {
      if (to.family() == AF_UNIX) {
        // Another user's process on a departed worker's name is not it.
        std::string refusal = localPeerRefusal(fd, options_.localPeersAnyUser);
        if (!refusal.empty()) {
          out[i] = {Knock::kRefused, "refused " + targets[i] + ": " + refusal};
          ::close(fd);
          continue;
        }
      }
      settle(i, 0);
      ::close(fd);
    } else if (errno == EINPROGRESS) {
      waiting.push_back(pollfd{fd, POLLOUT, 0});
      waitingFor.push_back(i);
    } else if (errno == EAGAIN && to.family() == AF_UNIX) {
      // A listener whose backlog is full: there, but whose is unknown
      // (another user's, never accepting, would pass for the worker).
      if (options_.localPeersAnyUser) {
        settle(i, 0);
      }
      ::close(fd);
    } else {
      settle(i, errno);
      ::close(fd);
    }
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  size_t open = waiting.size();
  while (open > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    int ready = ::poll(
        waiting.data(),
        waiting.size(),
        static_cast<int>(std::max<int64_t>(left.count(), 0)));
    if (ready < 0 && errno == EINTR) {
      continue;
    }
    if (ready <= 0) {
      break; // the rest are unknown
    }
    for (size_t k = 0; k < waiting.size(); ++k) {
      if (waiting[k].fd < 0 || waiting[k].revents == 0) {
        continue;
      }
      int error = 0;
      socklen_t len = sizeof(error);
      if (::getsockopt(waiting[k].fd, SOL_SOCKET, SO_ERROR, &error, &len) ==
          0) {
        settle(waitingFor[k], error);
      }
      ::close(waiting[k].fd);
      waiting[k].fd = -1; // poll() skips it from now on
      --open;
    }
  }
  for (const auto& p : waiting) {
    if (p.fd >= 0) {
      ::close(p.fd);
    }
  }
  return out;
}

namespace {

// The source host of a peer address ("1.2.3.4:5", "[::1]:5"); a local
// socket's (no port) counts as one host.
std::string hostOf(const std::string& peerAddress) {
  auto colon = peerAddress.rfind(':');
  if (colon == std::string::npos || peerAddress.empty() ||
      peerAddress[0] == '@' || peerAddress[0] == '/') {
    return "local";
  }
  return peerAddress.substr(0, colon);
}

} // namespace

void StreamTransport::acceptedFromLoop(
    int fd,
    std::string peerAddress,
    ConnectionObserver* observer) {
  // Forget the ones that authenticated or closed, then make room: a peer
  // that connects and says nothing holds a descriptor and buffers until
  // its handshake times out, so the oldest goes first.
  std::erase_if(unauthenticated_, [](const Unauthenticated& u) {
    auto c = u.conn.lock();
    return !c || c->isClosed() || c->isReady();
  });
  std::string host = hostOf(peerAddress);
  // A source whose proofs were refused too often lately is held off: closed
  // unread, before it costs a connection object or a handshake. (Local
  // sockets are one source for every process of the host; the listener
  // checks their user.)
  const bool local = host == "local";
  if (!local && strikes_->heldOff(host)) {
    ::close(fd);
    return;
  }
  size_t fromHost = 0;
  for (const auto& u : unauthenticated_) {
    fromHost += u.host == host ? 1 : 0;
  }
  auto evict = [this](
                   std::deque<Unauthenticated>::iterator it, const char* cap) {
    if (auto c = it->conn.lock()) {
      c->close(
          std::string("closed before it authenticated: the cap on ") + cap +
          " was reached and it was the oldest");
    }
    unauthenticated_.erase(it);
    ++unauthenticatedClosed_;
  };
  if (fromHost >= options_.maxUnauthenticatedPerHost) {
    auto it = std::find_if(
        unauthenticated_.begin(),
        unauthenticated_.end(),
        [&](const Unauthenticated& u) { return u.host == host; });
    evict(it, "unauthenticated connections from one host");
  } else if (unauthenticated_.size() >= options_.maxUnauthenticated) {
    // The oldest of the source holding the most: sources that fill the cap
    // between them (several addresses under the per-source cap) lose their
    // own, not a peer's handshake under way (the oldest of all, before).
    // Of sources holding as many (a prober with an address per connection,
    // tied with the peer at one each), the one whose oldest came first (the
    // deque is in accept order): a peer's handshake takes milliseconds, a
    // prober's silent connections wait out their timeout.
    std::unordered_map<std::string_view, size_t> bySource;
    size_t most = 0;
    for (const auto& u : unauthenticated_) {
      most = std::max(most, ++bySource[u.host]);
    }
    auto it = std::find_if(
        unauthenticated_.begin(),
        unauthenticated_.end(),
        [&](const Unauthenticated& u) { return bySource[u.host] == most; });
    evict(it, "unauthenticated connections (its source held the most)");
  }
  auto conn = newConnection(
      fd, /*outbound=*/false, -1, std::move(peerAddress), observer);
  if (!local) {
    conn->countRefusalsAgainst(strikes_, host);
  }
  adopt(conn);
  unauthenticated_.push_back(Unauthenticated{conn, std::move(host)});
  conn->startAcceptedFromLoop();
}

bool StreamTransport::closeOldestUnauthenticatedFromLoop(
    const std::string& why) {
  while (!unauthenticated_.empty()) {
    auto c = unauthenticated_.front().conn.lock();
    unauthenticated_.pop_front();
    if (c && !c->isClosed() && !c->isReady()) {
      c->close(why);
      ++unauthenticatedClosed_;
      return true;
    }
  }
  return false;
}

void StreamTransport::adopt(const std::shared_ptr<Connection>& conn) {
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

std::vector<std::shared_ptr<Connection>> StreamTransport::liveConnections() {
  std::vector<std::shared_ptr<Connection>> live;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& w : connections_) {
    auto c = w.lock();
    if (c && !c->isClosed()) {
      live.push_back(std::move(c));
    }
  }
  return live;
}

void StreamTransport::settleChannels() {
  for (const auto& c : liveConnections()) {
    c->settleChannels();
  }
}

bool StreamTransport::channelsSettled() {
  const auto live = liveConnections();
  return std::all_of(live.begin(), live.end(), [](const auto& c) {
    return c->channelsSettled();
  });
}

bool StreamTransport::postToLoop(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) {
      return false;
    }
  }
  loop_.post(std::move(fn)); // (dropped if the loop stops meanwhile)
  return true;
}

void StreamTransport::stop() {
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

} // namespace torch_rpc_ext::transport::stream
