// SPDX-License-Identifier: BSD-3-Clause
// The frame ring of StreamConnection (frame_ring.h): once both ends are
// ready, each one that passes descriptors (shm) and has
// TransportOptions::frameRingBytes sends its frames through a shared ring
// instead of its socket, announced by a kFrameRing frame, the last frame it
// writes to the socket. The socket then carries descriptor carriers (one
// byte each, with the descriptors of the frame that needs them: kFlagCarrier),
// the bodies of messages of the ring's size or more (kFlagBodyOnSocket), in
// the order of their frames, and the end of the connection.
// docs/wire-format.md, "Frame rings".
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "csrc/common/logging.h"
#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

namespace {

constexpr char kCarrier = 'F';

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
  uint64_t capacity = ring->capacity();
  std::string head(sizeof(capacity), '\0');
  std::memcpy(head.data(), &capacity, sizeof(capacity));
  PendingWrite w = controlFrame(
      {frame::FrameKind::kFrameRing,
       std::move(head),
       {ring->memFd(), ring->peerSignalFd()},
       nullptr});
  w.switchesToRing = true;
  std::weak_ptr<StreamConnection> weak = shared_from_this();
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    // Watched under the lock: a close from another thread comes after
    // outRing_ is set, and its teardown (on this thread) unwatches it.
    watchFromLoop(ring->signalFd(), [weak] {
      if (auto self = weak.lock()) {
        self->onRingSignalFromLoop(/*inbound=*/false);
      }
    });
    outRing_ = std::move(ring);
    // Behind what is queued (those go on the socket first): every later
    // frame goes through the ring.
    writes_.push_back(std::move(w));
    error = flushLocked();
  }
  afterFlush(error);
}

void StreamConnection::onRingSignalFromLoop(bool inbound) {
  FrameRing* ring = inbound ? inRing_.get() : outRing_.get();
  if (ring == nullptr || state_ == State::kClosed) {
    return;
  }
  SignalDrain drain = ring->drainSignals();
  if (drain == SignalDrain::kDescriptors) {
    loop_.removeFromLoop(ring->signalFd());
    loseFromLoop("the peer sent descriptors over a frame ring's signal socket");
    return;
  }
  if (drain == SignalDrain::kEnded) {
    // Its end closes with the peer's process (or the peer broke the
    // protocol): the connection ends once the peer's ring is read to its
    // end, as for the end of its socket.
    loop_.removeFromLoop(ring->signalFd());
    if (inRing_) {
      socketEnded_ = true;
      onReadableFromLoop();
    } else {
      // No ring of the peer's to read to its end, and no signal will ever
      // again say that ours has room: once it fills, our writes would wait
      // for good. (A peer that died also ends its socket; one that shut our
      // signal down and lives on would hold the connection open.)
      loseFromLoop("the peer ended our frame ring's signal socket");
    }
    return;
  }
  if (inbound) {
    onReadableFromLoop();
  } else {
    resumeWritesFromLoop();
  }
}

ssize_t StreamConnection::sendToRingLocked(
    const iovec* iov,
    int n,
    const std::vector<int>* fds,
    std::chrono::nanoseconds* ringWait) {
  size_t room = outRing_->room(&ringError_);
  if (room == 0 && ringError_.empty() && ringWait != nullptr &&
      ringWait->count() > 0) {
    auto t0 = std::chrono::steady_clock::now();
    room = outRing_->spinForRoom(
        std::min<std::chrono::nanoseconds>(kRingSenderSpin, *ringWait),
        &ringError_);
    *ringWait -= std::chrono::steady_clock::now() - t0;
  }
  if (room == 0 && ringError_.empty() && outRing_->parkSender()) {
    room = outRing_->room(&ringError_);
  }
  if (!ringError_.empty()) {
    errno = EPROTO;
    return -1;
  }
  if (room == 0) {
    errno = EAGAIN; // the receiver signals when it has taken some
    return -1;
  }
  if (fds != nullptr) {
    // The descriptors, with one byte, before the frame's first: the
    // receiver takes them off the socket when it parses a frame that passes
    // descriptors and the count says one is there.
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
  // A frame of at least the ring's size (the caller passes its wait
  // budget only then) is published in pieces as it is copied in.
  size_t done =
      outRing_->write(iov, n, room, /*piecewise=*/ringWait != nullptr);
  loop_.io().ringBytes.fetch_add(done, std::memory_order_relaxed);
  if (outRing_->wakeReceiver()) {
    Loop::Io::add(loop_.io().ringSignals);
  }
  return static_cast<ssize_t>(done);
}

bool StreamConnection::onFrameRingFromLoop() {
  if (inRing_ || tls_ || receivedFds_.size() < 2 ||
      head_.size() != sizeof(uint64_t)) {
    rejectFromLoop(
        inRing_    ? "rejected frame: a second frame ring"
            : tls_ ? "rejected frame: a frame ring on an encrypted connection"
                   : "rejected frame: a frame ring without its descriptors");
    return false;
  }
  uint64_t capacity;
  std::memcpy(&capacity, head_.data(), sizeof(capacity));
  int memFd = receivedFds_[0], signalFd = receivedFds_[1];
  receivedFds_.erase(receivedFds_.begin(), receivedFds_.begin() + 2);
  std::string error;
  inRing_ = FrameRing::attach(memFd, signalFd, capacity, &error);
  if (!inRing_) {
    rejectFromLoop("rejected frame ring: " + error);
    return false;
  }
  // Whatever the socket brought after the frame (carriers, a body) is the
  // socket's next bytes: taken first, as the frames from the ring say.
  socketStash_.assign(staging_.get() + stagedBegin_, stagedEnd_ - stagedBegin_);
  stagedBegin_ = stagedEnd_;
  std::weak_ptr<StreamConnection> weak = shared_from_this();
  watchFromLoop(inRing_->signalFd(), [weak] {
    if (auto self = weak.lock()) {
      self->onRingSignalFromLoop(/*inbound=*/true);
    }
  });
  {
    // From now on the socket is watched for its end only: its carriers are
    // taken as their frames are parsed.
    std::lock_guard<std::mutex> lock(writeMutex_);
    ringIn_ = true;
    if (registered_ && state_ != State::kClosed) {
      loop_.modify(fd_, readEvents() | (wantWrite_ ? uint32_t(EPOLLOUT) : 0u));
    }
  }
  loop_.watchRingFromLoop(fd_);
  return true;
}

bool StreamConnection::takeCarrierFromLoop() {
  if ((header_.flags & frame::kFlagCarrier) == 0) {
    return true;
  }
  // Sent and counted before the bytes of this frame were published, and
  // behind every earlier frame's on the socket (their carriers and bodies,
  // all read by now): the socket's next byte, with its descriptors.
  char byte = 0;
  ssize_t got = inRing_->carriersSent() > carriersReceived_
      ? readSocketFromLoop(&byte, 1, /*closeAtEnd=*/false)
      : 0;
  if (got == 1 && byte == kCarrier) {
    ++carriersReceived_;
    return true;
  }
  if (got >= 0 || got == kSocketEnded) {
    rejectFromLoop(
        got == 1 ? "rejected frame: a byte of a frame on the socket where a "
                   "descriptor carrier belongs"
                 : "rejected frame ring: the peer counts a descriptor carrier "
                   "it did not send");
  }
  return false;
}

void StreamConnection::markForRingLocked(PendingWrite& w) {
  w.ringMarked = true;
  if (w.written != 0) {
    return; // (frames after the ring's own frame start in the ring)
  }
  constexpr size_t kFlagsAt = offsetof(frame::FrameHeader, flags);
  uint16_t flags;
  std::memcpy(&flags, w.prefix.data() + kFlagsAt, sizeof(flags));
  if (!w.passFds.empty()) {
    flags |= frame::kFlagCarrier;
  } else if (
      flags == 0 &&
      w.prefix[offsetof(frame::FrameHeader, kind)] ==
          char(frame::FrameKind::kMessage)) {
    // A body of the ring's size or more: on the socket, whose buffer takes
    // megabytes a hand-off (tuneSocket) where the ring takes its capacity.
    // On a host with no idle core each hand-off waits for the other end to
    // be scheduled: 12 x 12 MB each way took 37-42 s under eight busy loops
    // through a 64 KiB ring, 1.7-1.8 s this way (docs/performance.md).
    uint64_t body = 0; // the stream's bytes: a region segment's record
    for (const auto& seg : w.frame.segments) {
      body += seg.size;
    }
    if (body >= outRing_->capacity()) {
      flags = frame::kFlagBodyOnSocket;
      w.bodyOnSocket = true;
      Loop::Io::add(loop_.io().ringSocketBodies);
    }
  }
  std::memcpy(w.prefix.data() + kFlagsAt, &flags, sizeof(flags));
}

bool StreamConnection::beginSocketBodyFromLoop() {
  // The stream's bytes of the segments: a region's one record, the bytes
  // of the rest (chunk channels' segments come with flags 1 only).
  bodyLeft_ = 0;
  for (size_t i = 0; i < segmentSizes_.size(); ++i) {
    uint8_t slot = carried_.empty() ? 0 : carried_[i];
    bool record = slot != 0 &&
        channels_[slot - 1]->context().mode() !=
            channel::Channel::Mode::kStaged;
    bodyLeft_ += record ? sizeof(frame::SegmentRecord) : segmentSizes_[i];
  }
  // What was read from the ring past this frame's head is read again once
  // the body is in; reads of the socket meanwhile stop at the body's end.
  ringStash_.insert(
      0, staging_.get() + stagedBegin_, stagedEnd_ - stagedBegin_);
  stagedBegin_ = stagedEnd_ = 0;
  watchSocketBodyFromLoop(true);
  return true;
}

void StreamConnection::watchSocketBodyFromLoop(bool reading) {
  // The socket's input is watched while a body is read (readEvents()).
  std::lock_guard<std::mutex> lock(writeMutex_);
  bodyOnSocket_ = reading;
  if (registered_ && state_ != State::kClosed) {
    loop_.modify(fd_, readEvents() | (wantWrite_ ? uint32_t(EPOLLOUT) : 0u));
  }
}

bool StreamConnection::ringInputFromLoop() {
  // (A body on the socket: its EPOLLIN says when there is input.)
  return inRing_ && !recordHeld_ && !bodyOnSocket_ &&
      state_ != State::kClosed &&
      (!ringStash_.empty() || inRing_->waiting() != 0);
}

bool StreamConnection::parkRingFromLoop() {
  return inRing_ && !recordHeld_ && !bodyOnSocket_ &&
      state_ != State::kClosed &&
      (!ringStash_.empty() || inRing_->parkReceiver());
}

ssize_t StreamConnection::readFromLoop(void* dst, size_t size, bool piecewise) {
  if (!inRing_) {
    return readSocketFromLoop(dst, size);
  }
  if (bodyOnSocket_) {
    // Never past the body: the socket's next bytes are a later frame's.
    size = static_cast<size_t>(std::min<uint64_t>(size, bodyLeft_));
    ssize_t got = size == 0 ? 0 : readSocketFromLoop(dst, size);
    if (got > 0) {
      bodyLeft_ -= static_cast<uint64_t>(got);
    }
    return got;
  }
  if (!ringStash_.empty()) {
    return takeStashed(ringStash_, dst, size);
  }
  std::string error;
  int64_t got = inRing_->read(dst, size, &error, piecewise);
  if (got < 0) {
    rejectFromLoop("rejected frame ring: " + error);
    return -1;
  }
  if (got == 0 && socketEnded_ && inRing_->waiting() == 0) {
    // The peer's last frames are read: now its end counts.
    closeInternal(kPeerClosed, false);
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
