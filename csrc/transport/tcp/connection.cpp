// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/connection.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "csrc/common/logging.h"
#include "csrc/transport/handshake.h"
#include "csrc/transport/tcp/address.h"

namespace torch_rpc_ext::transport::tcp {

namespace {

constexpr size_t kStagingBytes = 64 * 1024;
constexpr uint64_t kRingCapacity = 8 * 1024 * 1024;

// Watches the eventfd of a connection's outbound ring.
class RingWaker final : public Pollable {
 public:
  explicit RingWaker(std::weak_ptr<TcpConnection> conn)
      : conn_(std::move(conn)) {}
  void handleEventsFromLoop(uint32_t /*events*/) override {
    if (auto c = conn_.lock()) {
      c->onRingWakeFromLoop();
    }
  }

 private:
  std::weak_ptr<TcpConnection> conn_;
};

void tuneSocket(int fd, bool shm) {
  int one = 1;
  if (!shm) {
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  }
}

} // namespace

TcpConnection::TcpConnection(
    Loop& loop,
    const TransportOptions& options,
    int fd,
    bool outbound,
    int32_t expectedPeerId,
    std::string peerAddress,
    ConnectionObserver* observer,
    bool shm)
    : loop_(loop),
      options_(options),
      fd_(fd),
      outbound_(outbound),
      expectedPeerId_(expectedPeerId),
      peerAddress_(std::move(peerAddress)),
      observer_(observer),
      shm_(shm),
      state_(outbound ? State::kConnecting : State::kHandshake),
      handshake_(outbound, options.secret, options.selfId, expectedPeerId),
      staging_(kStagingBytes) {}

TcpConnection::~TcpConnection() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
  for (int fd : receivedFds_) {
    ::close(fd);
  }
}

std::shared_ptr<TcpConnection> TcpConnection::connect(
    Loop& loop,
    const TransportOptions& options,
    const std::string& address,
    int32_t expectedPeerId,
    ConnectionObserver* observer,
    bool shm) {
  SocketAddress to = SocketAddress::parse(address);
  int fd = ::socket(to.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  auto conn = std::shared_ptr<TcpConnection>(new TcpConnection(
      loop, options, fd, /*outbound=*/true, expectedPeerId, address, observer,
      shm));
  if (fd < 0) {
    conn->fd_ = -1;
    conn->closeInternal(errnoText("socket"), false);
    return conn;
  }
  tuneSocket(fd, shm);
  if (shm) {
    try {
      conn->ringOut_ = shm::Ring::create(kRingCapacity);
    } catch (const std::exception& e) {
      conn->closeInternal(std::string("shared-memory ring: ") + e.what(), false);
      return conn;
    }
  }
  int rv = ::connect(fd, reinterpret_cast<sockaddr*>(&to.storage), to.length);
  if (rv != 0 && errno != EINPROGRESS) {
    conn->closeInternal(
        "connect to " + address + " failed: " + std::strerror(errno), false);
    return conn;
  }
  loop.post([conn] { conn->startFromLoop(/*connecting=*/true); });
  return conn;
}

std::shared_ptr<TcpConnection> TcpConnection::acceptFromLoop(
    Loop& loop,
    const TransportOptions& options,
    int fd,
    std::string peerAddress,
    ConnectionObserver* observer,
    bool shm) {
  tuneSocket(fd, shm);
  auto conn = std::shared_ptr<TcpConnection>(new TcpConnection(
      loop, options, fd, /*outbound=*/false, -1, std::move(peerAddress),
      observer, shm));
  if (shm) {
    try {
      conn->ringOut_ = shm::Ring::create(kRingCapacity);
    } catch (const std::exception& e) {
      conn->registered_ = false;
      conn->closeInternal(std::string("shared-memory ring: ") + e.what(), false);
      return conn;
    }
  }
  conn->startFromLoop(/*connecting=*/false);
  return conn;
}

void TcpConnection::startFromLoop(bool connecting) {
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    registered_ = true;
    wantWrite_ = connecting || !writes_.empty();
    uint32_t events = EPOLLIN | (wantWrite_ ? uint32_t(EPOLLOUT) : 0u);
    loop_.addFromLoop(fd_, shared_from_this(), events);
    if (shm_) {
      loop_.addFromLoop(
          ringOut_.wakeFd(),
          std::make_shared<RingWaker>(weak_from_this()),
          EPOLLIN);
    }
  }
  std::weak_ptr<TcpConnection> weak = shared_from_this();
  loop_.runAfter(options_.handshakeTimeout, [weak] {
    if (auto self = weak.lock()) {
      if (!self->isReady() && !self->isClosed()) {
        self->closeInternal("handshake did not complete in time", false);
      }
    }
  });
}

std::string TcpConnection::describe() const {
  return std::string(shm_ ? "shm " : "tcp ") + (outbound_ ? "to " : "from ") + peerAddress_ +
      (peerId_ >= 0 ? " (worker id " + std::to_string(peerId_.load()) + ")"
                    : "");
}

std::string TcpConnection::closeReason() const {
  std::lock_guard<std::mutex> lock(writeMutex_);
  return closeReason_;
}

void TcpConnection::handleEventsFromLoop(uint32_t events) {
  if (state_ == State::kClosed) {
    return;
  }
  if (state_ == State::kConnecting) {
    if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) {
      onConnectedFromLoop();
    }
    return;
  }
  if (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
    onReadableFromLoop();
  }
  if ((events & EPOLLOUT) && state_ != State::kClosed) {
    std::string error;
    {
      std::lock_guard<std::mutex> lock(writeMutex_);
      error = flushLocked();
    }
    afterFlush(error);
  }
}

void TcpConnection::afterFlush(const std::string& error) {
  releaseFinished();
  if (!error.empty()) {
    closeInternal(error, false);
  }
}

void TcpConnection::releaseFinished() {
  std::vector<std::shared_ptr<void>> done;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    done.swap(finished_);
  }
  if (done.empty()) {
    return;
  }
  if (options_.releaseOffLoop && loop_.inLoop()) {
    for (auto& d : done) {
      options_.releaseOffLoop(std::move(d));
    }
  }
}

void TcpConnection::scheduleHeartbeat() {
  if (options_.heartbeatTimeout.count() <= 0) {
    return;
  }
  std::weak_ptr<TcpConnection> weak = weak_from_this();
  loop_.runAfter(options_.heartbeatTimeout / 5, [weak] {
    if (auto self = weak.lock()) {
      self->heartbeatFromLoop();
    }
  });
}

void TcpConnection::heartbeatFromLoop() {
  if (state_ != State::kReady) {
    return;
  }
  auto silent = std::chrono::steady_clock::now().time_since_epoch() -
      std::chrono::steady_clock::duration(lastActivity_.load());
  if (silent >= options_.heartbeatTimeout) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(silent);
    closeInternal(
        "no sign of life from the peer for " +
            std::to_string(ms.count() / 1000.0).substr(0, 5) +
            " s (heartbeat_timeout)",
        false);
    return;
  }
  if (silent >= options_.heartbeatTimeout / 5) {
    queueControl(uint8_t(FrameKind::kPing), {});
  }
  if (shm_) {
    // Memory goes back once traffic stops: releases still waiting for a
    // frame to ride with, then our free slabs idle for 2 s.
    flushReleases();
    trimSlabs();
  }
  scheduleHeartbeat();
}

void TcpConnection::onConnectedFromLoop() {
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    closeInternal(
        "connect to " + peerAddress_ + " failed: " + std::strerror(err), false);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    state_ = State::kHandshake;
  }
  queueControl(uint8_t(FrameKind::kHello), handshake_.hello());
}

bool TcpConnection::onHandshakeFrameFromLoop(std::string head) {
  Handshake::Step step = handshake_.onFrame(head);
  if (!step.error.empty()) {
    closeInternal(step.error, false);
    return false;
  }
  if (step.hasReply) {
    queueControl(uint8_t(step.replyKind), std::move(step.replyHead));
  }
  if (!step.done) {
    return state_ != State::kClosed;
  }
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return false;
    }
    peerId_ = handshake_.peerId();
    state_ = State::kReady;
    if (shm_) {
      queueRingSetupLocked();
    }
    error = flushLocked();
  }
  releaseFinished();
  if (!error.empty()) {
    closeInternal(error, false);
    return false;
  }
  noteActivity();
  scheduleHeartbeat();
  observer_->onReady(shared_from_this());
  return state_ != State::kClosed;
}

void TcpConnection::close(const std::string& reason) {
  closeInternal(reason, true);
}

void TcpConnection::closeInternal(std::string reason, bool local) {
  std::deque<PendingWrite> dropped;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    state_ = State::kClosed;
    dropped.swap(writes_);
    for (auto& w : dropped) {
      if (w.frame.keepAlive) {
        finished_.push_back(std::move(w.frame.keepAlive));
      }
    }
    closeReason_ = reason;
  }
  releaseFinished();
  if (!local && !reason.empty()) {
    logDebug("torch_rpc_ext: closing " + describe() + ": " + reason);
  }
  auto self = shared_from_this();
  auto finish = [self, reason] {
    if (self->registered_) {
      self->loop_.removeFromLoop(self->fd_);
      if (self->shm_) {
        self->loop_.removeFromLoop(self->ringOut_.wakeFd());
      }
    }
    if (self->fd_ >= 0) {
      ::shutdown(self->fd_, SHUT_RDWR);
    }
    self->observer_->onClosed(*self, reason);
  };
  if (loop_.inLoop()) {
    finish();
  } else {
    loop_.post(finish);
  }
}

} // namespace torch_rpc_ext::transport::tcp
