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
constexpr int kMaxIov = 1024;
// shm: segments this large go through the ring, in chunks of kRingChunk.
constexpr size_t kRingMinSegment = 64 * 1024;
constexpr size_t kRingChunk = 1024 * 1024;
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

std::string errnoText(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

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
    releaseFinished();
    if (!error.empty()) {
      closeInternal(error, false);
    }
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
  scheduleHeartbeat();
}

void TcpConnection::onRingWakeFromLoop() {
  ringOut_.drainWakeups();
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    ringBlocked_ = false;
    error = flushLocked();
  }
  releaseFinished();
  if (!error.empty()) {
    closeInternal(error, false);
  }
}

void TcpConnection::queueRingSetupLocked() {
  PendingWrite w;
  uint64_t capacity = ringOut_.capacity();
  FrameHeader h{kFrameMagic, kProtocolVersion, uint8_t(FrameKind::kRing), 0,
                sizeof(capacity), 0, 0};
  w.prefix.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  w.prefix.append(reinterpret_cast<const char*>(&capacity), sizeof(capacity));
  w.control = true;
  w.passFds = {ringOut_.fd(), ringOut_.wakeFd()};
  // After the handshake frames still queued, before any message.
  auto pos = writes_.begin();
  while (pos != writes_.end() && pos->control) {
    ++pos;
  }
  writes_.insert(pos, std::move(w));
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

void TcpConnection::queueControl(uint8_t kind, std::string head) {
  PendingWrite w;
  FrameHeader h{kFrameMagic, kProtocolVersion, kind, 0,
                static_cast<uint32_t>(head.size()), 0, 0};
  w.prefix.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  w.prefix += head;
  w.control = true;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    // Control frames jump the queue: nothing else is sent before kReady, and
    // a pong may not split a frame that is partly written.
    auto pos = writes_.begin();
    if (pos != writes_.end() && pos->written > 0) {
      ++pos;
    }
    writes_.insert(pos, std::move(w));
    error = flushLocked();
  }
  releaseFinished();
  if (!error.empty()) {
    closeInternal(error, false);
  }
}

bool TcpConnection::write(OutboundFrame frame) {
  if (frame.segments.size() > options_.limits.maxSegments ||
      frame.head.size() > options_.limits.maxHeadBytes ||
      frame.wireSize() > options_.limits.maxFrameBytes) {
    throw std::length_error(
        "frame of " + std::to_string(frame.wireSize()) + " bytes in " +
        std::to_string(frame.segments.size()) +
        " segments exceeds this agent's limits (max_frame_bytes=" +
        std::to_string(options_.limits.maxFrameBytes) + ")");
  }
  PendingWrite w;
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.version = kProtocolVersion;
  h.kind = uint8_t(frame.kind);
  h.headLength = static_cast<uint32_t>(frame.head.size());
  h.numSegments = static_cast<uint32_t>(frame.segments.size());
  bool anyRing = false;
  for (const auto& s : frame.segments) {
    h.dataLength += s.size;
    anyRing = anyRing || (shm_ && s.size >= kRingMinSegment);
  }
  if (anyRing) {
    h.flags = kFlagRingSegments;
    w.ring.resize(frame.segments.size());
  }
  w.prefix.reserve(sizeof(h) + 8 * frame.segments.size() + frame.head.size());
  w.prefix.append(reinterpret_cast<const char*>(&h), sizeof(h));
  for (size_t i = 0; i < frame.segments.size(); ++i) {
    uint64_t n = frame.segments[i].size;
    if (anyRing && n >= kRingMinSegment) {
      w.ring[i] = true;
      n |= kRingSegmentBit;
    }
    w.prefix.append(reinterpret_cast<const char*>(&n), 8);
  }
  w.prefix += frame.head;
  frame.head.clear();
  w.frame = std::move(frame);
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return false;
    }
    writes_.push_back(std::move(w));
    if (state_ == State::kReady && writes_.size() == 1) {
      error = flushLocked();
    }
  }
  releaseFinished();
  if (!error.empty()) {
    closeInternal(error, false);
  }
  return true;
}

std::string TcpConnection::flushLocked() {
  if (state_ == State::kClosed || !registered_) {
    return {};
  }
  while (!writes_.empty()) {
    if (state_ != State::kReady && !writes_.front().control) {
      break;
    }
    if (!writes_.front().ring.empty()) {
      if (ringBlocked_) {
        break;
      }
      std::string error;
      RingFlush r = flushRingFrameLocked(writes_.front(), &error);
      if (!error.empty()) {
        return error;
      }
      if (r != RingFlush::kDone) {
        ringBlocked_ = r == RingFlush::kRingFull;
        break;
      }
      auto& w = writes_.front();
      if (w.frame.keepAlive) {
        finished_.push_back(std::move(w.frame.keepAlive));
      }
      writes_.pop_front();
      continue;
    }
    iovec iov[kMaxIov];
    int n = 0;
    const std::vector<int>* fds = nullptr;
    for (auto& w : writes_) {
      if (state_ != State::kReady && !w.control) {
        break;
      }
      if (!w.ring.empty()) {
        break; // written on its own, above
      }
      if (!w.passFds.empty() && w.written == 0) {
        if (n > 0) {
          break; // descriptors ride on the first byte of their own send
        }
        fds = &w.passFds;
      }
      size_t skip = w.written;
      auto add = [&](const void* p, size_t len) {
        if (n == kMaxIov || len == 0) {
          return;
        }
        if (skip >= len) {
          skip -= len;
          return;
        }
        iov[n].iov_base = const_cast<char*>(static_cast<const char*>(p)) + skip;
        iov[n].iov_len = len - skip;
        skip = 0;
        ++n;
      };
      add(w.prefix.data(), w.prefix.size());
      for (const auto& s : w.frame.segments) {
        add(s.data, s.size);
      }
      if (n == kMaxIov || fds != nullptr) {
        break;
      }
    }
    if (n == 0) {
      break;
    }
    ssize_t sent = sendLocked(iov, n, fds);
    if (sent < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        break;
      }
      if (errno == EINTR) {
        continue;
      }
      return errnoText("write failed");
    }
    if (sent > 0 && !writes_.front().control) {
      // Our own pings prove nothing: the kernel takes them from a frozen
      // peer's socket too. Data draining from the buffer does.
      noteActivity();
    }
    size_t left = static_cast<size_t>(sent);
    while (left > 0 && !writes_.empty()) {
      auto& w = writes_.front();
      size_t total = w.prefix.size();
      for (const auto& s : w.frame.segments) {
        total += s.size;
      }
      size_t need = total - w.written;
      if (left >= need) {
        left -= need;
        if (w.frame.keepAlive) {
          finished_.push_back(std::move(w.frame.keepAlive));
        }
        writes_.pop_front();
      } else {
        w.written += left;
        left = 0;
      }
    }
  }
  updateEventsLocked();
  return {};
}

ssize_t TcpConnection::sendLocked(
    const iovec* iov,
    int n,
    const std::vector<int>* fds) {
  if (fds == nullptr) {
    return ::writev(fd_, iov, n);
  }
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(n);
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds->size());
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds->size());
  std::memcpy(CMSG_DATA(c), fds->data(), sizeof(int) * fds->size());
  return ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
}

TcpConnection::RingFlush TcpConnection::flushRingFrameLocked(
    PendingWrite& w,
    std::string* error) {
  const auto& segments = w.frame.segments;
  while (true) {
    // Records first: the consumer can only take chunks it has heard of.
    if (w.recordsWritten < w.records.size()) {
      ssize_t got = ::send(
          fd_, w.records.data() + w.recordsWritten,
          w.records.size() - w.recordsWritten, MSG_NOSIGNAL);
      if (got < 0) {
        if (errno == EINTR) {
          continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          return RingFlush::kSocketFull;
        }
        *error = errnoText("write failed");
        return RingFlush::kSocketFull;
      }
      w.recordsWritten += static_cast<size_t>(got);
      noteActivity();
      if (w.recordsWritten == w.records.size()) {
        w.records.clear();
        w.recordsWritten = 0;
      }
      continue;
    }
    if (w.piece > segments.size()) {
      return RingFlush::kDone;
    }
    const char* data;
    size_t size;
    if (w.piece == 0) {
      data = w.prefix.data();
      size = w.prefix.size();
    } else {
      data = static_cast<const char*>(segments[w.piece - 1].data);
      size = segments[w.piece - 1].size;
    }
    if (w.pieceOffset == size) {
      ++w.piece;
      w.pieceOffset = 0;
      continue;
    }
    w.written = 1; // started: control frames must wait behind it
    if (w.piece > 0 && w.ring[w.piece - 1]) {
      shm::ChunkRecord record{};
      size_t n = ringOut_.produce(
          data + w.pieceOffset, size - w.pieceOffset, kRingChunk, &record,
          error);
      if (!error->empty()) {
        return RingFlush::kSocketFull;
      }
      if (n == 0) {
        return RingFlush::kRingFull;
      }
      w.pieceOffset += n;
      w.records.append(reinterpret_cast<const char*>(&record), sizeof(record));
      continue;
    }
    ssize_t got = ::send(
        fd_, data + w.pieceOffset, size - w.pieceOffset, MSG_NOSIGNAL);
    if (got < 0) {
      if (errno == EINTR) {
        continue;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return RingFlush::kSocketFull;
      }
      *error = errnoText("write failed");
      return RingFlush::kSocketFull;
    }
    w.pieceOffset += static_cast<size_t>(got);
    noteActivity();
  }
}

void TcpConnection::updateEventsLocked() {
  bool want = !writes_.empty() &&
      (state_ == State::kReady || writes_.front().control) &&
      !(ringBlocked_ && !writes_.front().ring.empty());
  if (registered_ && want != wantWrite_ && state_ != State::kClosed) {
    wantWrite_ = want;
    loop_.modify(fd_, EPOLLIN | (want ? uint32_t(EPOLLOUT) : 0u));
  }
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
