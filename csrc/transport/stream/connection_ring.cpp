// SPDX-License-Identifier: BSD-3-Clause
// The frame ring of StreamConnection (frame_ring.h): once both ends are
// ready, each one that passes descriptors (shm) and has
// TransportOptions::frameRingBytes sends its frames through a shared ring
// instead of its socket, announced by a kFrameRing frame, the last frame it
// writes to the socket. The socket then carries only descriptor carriers
// (one byte each, with the descriptors of the frame that needs them) and
// the end of the connection. docs/wire-format.md, "Frame rings".
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "csrc/common/logging.h"
#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

namespace {

constexpr char kCarrier = 'F';

void drainEventFd(int fd) {
  uint64_t n;
  ssize_t rv = ::read(fd, &n, sizeof(n));
  (void)rv;
}

} // namespace

void StreamConnection::offerFrameRingFromLoop() {
  if (options_.frameRingBytes == 0 || !passesDescriptors() || tls_) {
    return; // (an encrypted connection keeps every byte in its session)
  }
  std::unique_ptr<FrameRing> ring;
  try {
    ring = FrameRing::create(options_.frameRingBytes);
  } catch (const std::exception& e) {
    logWarning(
        std::string("torch_rpc_ext: ") + describe() +
        " keeps its frames on the socket: no frame ring (" + e.what() + ")");
    return;
  }
  std::weak_ptr<StreamConnection> weak = shared_from_this();
  int spaceFd = ring->spaceFd();
  watchFromLoop(spaceFd, [weak, spaceFd] {
    drainEventFd(spaceFd);
    if (auto self = weak.lock()) {
      self->resumeWritesFromLoop();
    }
  });
  uint64_t capacity = ring->capacity();
  std::string head(sizeof(capacity), '\0');
  std::memcpy(head.data(), &capacity, sizeof(capacity));
  PendingWrite w = controlFrame(
      {frame::FrameKind::kFrameRing,
       std::move(head),
       {ring->memFd(), ring->dataFd(), ring->spaceFd()},
       nullptr});
  w.switchesToRing = true;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    outRing_ = std::move(ring);
    // Behind what is queued (those go on the socket first), ahead of
    // nothing: every later frame goes through the ring.
    writes_.push_back(std::move(w));
    error = flushLocked();
  }
  afterFlush(error);
}

ssize_t StreamConnection::sendToRingLocked(
    const iovec* iov,
    int n,
    const std::vector<int>* fds) {
  size_t room = outRing_->room(&ringError_);
  if (room == 0 && ringError_.empty() && outRing_->parkSender()) {
    room = outRing_->room(&ringError_);
  }
  if (!ringError_.empty()) {
    errno = EPROTO;
    return -1;
  }
  if (room == 0) {
    errno = EAGAIN; // the receiver signals spaceFd() when it has taken some
    return -1;
  }
  if (fds != nullptr) {
    // The descriptors, with one byte, before the frame's first: the
    // receiver reads the socket when the count says it has one to take.
    char carrier = kCarrier;
    iovec one{&carrier, 1};
    ssize_t sent = sendSocketLocked(&one, 1, fds);
    if (sent <= 0) {
      carrierBlocked_ = sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
      return sent < 0 ? -1 : (errno = EAGAIN, -1);
    }
    carrierBlocked_ = false;
    outRing_->countCarrier();
  }
  Loop::Io::add(loop_.io().ringWrites);
  size_t done = outRing_->write(iov, n, room);
  loop_.io().ringBytes.fetch_add(done, std::memory_order_relaxed);
  if (outRing_->wakeReceiver()) {
    Loop::Io::add(loop_.io().ringSignals);
  }
  return static_cast<ssize_t>(done);
}

bool StreamConnection::onFrameRingFromLoop() {
  if (inRing_ || tls_ || receivedFds_.size() < 3 ||
      head_.size() != sizeof(uint64_t)) {
    rejectFromLoop(
        inRing_    ? "rejected frame: a second frame ring"
            : tls_ ? "rejected frame: a frame ring on an encrypted connection"
                   : "rejected frame: a frame ring without its descriptors");
    return false;
  }
  uint64_t capacity;
  std::memcpy(&capacity, head_.data(), sizeof(capacity));
  int memFd = receivedFds_[0], dataFd = receivedFds_[1];
  int spaceFd = receivedFds_[2];
  receivedFds_.erase(receivedFds_.begin(), receivedFds_.begin() + 3);
  std::string error;
  inRing_ = FrameRing::attach(memFd, dataFd, spaceFd, capacity, &error);
  if (!inRing_) {
    rejectFromLoop("rejected frame ring: " + error);
    return false;
  }
  // Whatever the socket brought after the frame is carriers.
  size_t rest = stagedEnd_ - stagedBegin_;
  stagedBegin_ = stagedEnd_;
  if (!takeCarriersFromLoop(staging_.get() + stagedEnd_ - rest, rest)) {
    return false;
  }
  std::weak_ptr<StreamConnection> weak = shared_from_this();
  watchFromLoop(dataFd, [weak, dataFd] {
    drainEventFd(dataFd);
    if (auto self = weak.lock()) {
      self->onReadableFromLoop();
    }
  });
  loop_.watchRingFromLoop(fd_);
  return true;
}

bool StreamConnection::takeCarriersFromLoop(const char* data, size_t size) {
  for (size_t i = 0; i < size; ++i) {
    if (data[i] != kCarrier) {
      rejectFromLoop(
          "rejected frame: a byte of a frame on the socket after the frame "
          "ring took over");
      return false;
    }
  }
  carriersReceived_ += size;
  return true;
}

bool StreamConnection::drainSocketFromLoop() {
  char bytes[64];
  while (!socketEnded_) {
    ssize_t got =
        readSocketFromLoop(bytes, sizeof(bytes), /*closeAtEnd=*/false);
    if (got == kSocketEnded) {
      socketEnded_ = true; // closed once the ring is read to its end
      return true;
    }
    if (got < 0) {
      return false;
    }
    if (got == 0) {
      return true;
    }
    if (!takeCarriersFromLoop(bytes, static_cast<size_t>(got))) {
      return false;
    }
  }
  return true;
}

bool StreamConnection::ringInputFromLoop() {
  return inRing_ && !recordHeld_ && state_ != State::kClosed &&
      inRing_->waiting() != 0;
}

bool StreamConnection::parkRingFromLoop() {
  return inRing_ && !recordHeld_ && state_ != State::kClosed &&
      inRing_->parkReceiver();
}

ssize_t StreamConnection::readFromLoop(void* dst, size_t size) {
  if (!inRing_) {
    return readSocketFromLoop(dst, size);
  }
  // The bytes first, then the carriers: a frame's descriptors were counted
  // before its bytes were published, so they are on the socket by now.
  int64_t waiting = inRing_->waiting();
  if (socketReadable_ || inRing_->carriersSent() > carriersReceived_) {
    socketReadable_ = false;
    if (!drainSocketFromLoop()) {
      return -1;
    }
    if (inRing_->carriersSent() > carriersReceived_) {
      rejectFromLoop(
          "rejected frame ring: the peer counts descriptor carriers it did "
          "not send");
      return -1;
    }
  }
  std::string error;
  int64_t got = waiting < 0
      ? -1
      : inRing_->read(
            dst, std::min(size, static_cast<size_t>(waiting)), &error);
  if (got < 0) {
    rejectFromLoop(
        "rejected frame ring: " +
        (error.empty() ? std::string("an impossible position") : error));
    return -1;
  }
  if (got == 0 && socketEnded_) {
    // The peer's last frames are read: now its end counts.
    closeInternal("peer closed the connection", false);
    return -1;
  }
  if (got > 0) {
    Loop::Io::add(loop_.io().ringReads);
    noteActivity();
    if (inRing_->wakeSender()) {
      Loop::Io::add(loop_.io().ringSignals);
    }
  }
  return got;
}

} // namespace torch_rpc_ext::transport::stream
