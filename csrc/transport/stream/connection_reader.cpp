// SPDX-License-Identifier: BSD-3-Clause
// The read side of StreamConnection: the incremental frame parser. Runs on the
// loop thread only; validates each header before allocating anything behind
// it (connection_headers.cpp), and leaves what only a channel knows (its
// control frames, the records of out-of-band segments) to the connection's
// channels.
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "csrc/common/fd_closer.h"
#include "csrc/common/logging.h"
#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

namespace {

constexpr size_t kDirectReadBytes = 16 * 1024;
// The most one read from a frame ring takes straight into a segment.
constexpr size_t kRingReadMax = 1024 * 1024;
// Descriptors that may wait before the handshake ends (more close the
// connection; the control buffer takes all a message can carry, so the
// kernel never drops any).
constexpr size_t kMaxFdsPerRead = 4;
constexpr size_t kStagingBytes = 64 * 1024;

} // namespace

std::string StreamConnection::refusedProofText() const {
  return "authentication failed: the peer closed the connection after our "
         "proof, refusing it (a different secret, a relay between us, or in "
         "a dynamic group an id or incarnation it does not admit; its log "
         "says)";
}

ssize_t StreamConnection::readSocketFromLoop(
    void* dst,
    size_t size,
    bool closeAtEnd) {
  Loop::Io::add(loop_.io().reads);
  if (tls_) {
    std::string error;
    ssize_t got = tls_->read(dst, size, &error);
    if (got > 0) {
      noteActivity();
    } else if (got < 0) {
      // The peer's end, not a record that failed, is what refuses a proof.
      closeInternal(
          handshake_.awaitingServerProof() && error.rfind("peer closed", 0) == 0
              ? refusedProofText() + " (TLS: " + error + ")"
              : error,
          false);
    }
    if (got >= 0 && tls_->hasPendingOutput()) {
      // A read wrote (a key update's answer) and the socket was full.
      std::lock_guard<std::mutex> lock(writeMutex_);
      updateEventsLocked();
    }
    return got;
  }
  if (!socketStash_.empty()) {
    // Read past the kFrameRing frame with it (its descriptors came then).
    return takeStashed(socketStash_, dst, size);
  }
  while (true) {
    // recvmsg, not read: read(2) would have the kernel drop descriptors a
    // peer passed on a Unix socket, and close them on this thread
    // (fd_closer.h). (The same call on a TCP socket, which carries none.)
    iovec iov{dst, size};
    // Room for the most one message carries: a smaller buffer would have
    // the kernel drop (and close, on this thread) what did not fit.
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t got = ::recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
    if (got >= 0) {
      const size_t waiting = receivedFds_.size();
      collectPassedFds(msg, receivedFds_);
      // More than could be waiting for their frames is an attack on our
      // descriptor table (any at all where no channel takes them). Before
      // the handshake ends, the channels (which set the bound) are not open
      // yet, while one read may already bring the descriptors of the
      // peer's first frame after it: they wait, and are counted once the
      // channels are (openChannels()).
      // Once it is ready, one read brings one frame's at most (a read ends
      // after the bytes that bring descriptors).
      const bool ready = state_ == State::kReady;
      size_t bound = !passesDescriptors() ? 0
          : ready                         ? maxPendingFds_
                                          : kMaxFdsPerRead;
      if ((msg.msg_flags & MSG_CTRUNC) != 0 || receivedFds_.size() > bound ||
          (ready && receivedFds_.size() - waiting > maxFdsPerFrame_)) {
        rejectFromLoop("peer sent unexpected file descriptors");
        return -1;
      }
    }
    if (got > 0) {
      noteActivity();
      receivedAny_ = true;
      return got;
    }
    if (got == 0 && !closeAtEnd) {
      return kSocketEnded;
    }
    if (!outbound_ && !receivedAny_ && (got == 0 || errno == ECONNRESET)) {
      closeKnockedFromLoop(/*reset=*/got != 0); // (SO_LINGER 0: a reset)
      return -1;
    }
    if (got == 0) {
      closeInternal(
          state_ != State::kHandshake ? kPeerClosed
              : handshake_.awaitingServerProof()
              ? refusedProofText()
              : "peer closed the connection during the handshake (it "
                "refused us: a different secret or `encryption` setting? "
                "or it was busy: over its cap on unauthenticated "
                "connections, or past its handshake_timeout; or it holds "
                "off our address after refused proofs; its log says)",
          false);
      return -1;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return 0;
    }
    if (errno != EINTR) {
      closeInternal(errnoText("read failed"), false);
      return -1;
    }
  }
}

void StreamConnection::advanceSegmentFromLoop(size_t bytes) {
  segmentFilled_ += bytes;
  if (segmentFilled_ == segmentSizes_[segmentIndex_]) {
    ++segmentIndex_;
    segmentFilled_ = 0;
    skipEmptySegments();
    if (segmentIndex_ == segmentSizes_.size()) {
      finishFrameFromLoop();
    }
  }
}

void StreamConnection::onReadableFromLoop() {
  // A frame ring that keeps having input (a large segment streaming in, or
  // frames one after another) keeps this call reading, and waiting for the
  // sender's next piece, for at most kRingWaitPerFlush; then the loop serves
  // its other connections and comes back at once, since the ring has input
  // (or, empty and parked, is signalled by the sender's next write). Only
  // between frames or pieces: what is staged is always parsed first.
  const auto ringDeadline = inRing_
      ? std::chrono::steady_clock::now() + kRingWaitPerFlush
      : std::chrono::steady_clock::time_point{};
  // The last large read took a whole published piece: the sender is
  // streaming in pieces, so the next one is worth waiting for.
  bool streaming = false;
  while (state_ != State::kClosed && !recordHeld_) {
    if (inRing_ && std::chrono::steady_clock::now() >= ringDeadline) {
      return; // the loop comes back: ringInputFromLoop()
    }
    // Large remainders of a segment go straight into its final buffer.
    if (phase_ == ReadPhase::kSegments && stagedBegin_ == stagedEnd_ &&
        bytesInline()) {
      size_t want = segmentSizes_[segmentIndex_] - segmentFilled_;
      if (want >= kDirectReadBytes) {
        char* dst = inlineTargetFromLoop();
        if (dst == nullptr) {
          return;
        }
        if (inRing_) {
          // A read of a large ring (up to 64 MiB) in one piece would run
          // past the deadline by itself.
          want = std::min(want, kRingReadMax);
        }
        ssize_t got = readFromLoop(dst, want, /*piecewise=*/true);
        if (got == 0 && streaming && inRing_ && !bodyOnSocket_ &&
            state_ != State::kClosed) {
          streaming = false;
          auto left = ringDeadline - std::chrono::steady_clock::now();
          if (left.count() > 0 &&
              inRing_->spinForBytes(
                  std::min<std::chrono::nanoseconds>(
                      kRingReceiverSpin, left))) {
            continue; // the sender is mid-frame: more came while we waited
          }
        }
        streaming =
            inRing_ && !bodyOnSocket_ && got >= ssize_t(kFrameRingPublishStep);
        if (got <= 0) {
          return;
        }
        if (!inlineArrivedFromLoop(static_cast<size_t>(got))) {
          return;
        }
        continue;
      }
    }
    streaming = false;
    if (stagedBegin_ == stagedEnd_) {
      stagedBegin_ = stagedEnd_ = 0;
    }
    if (!staging_) {
      staging_.reset(new char[kStagingBytes]);
    }
    ssize_t got =
        readFromLoop(staging_.get() + stagedEnd_, kStagingBytes - stagedEnd_);
    if (got <= 0) {
      return;
    }
    stagedEnd_ += static_cast<size_t>(got);
    if (!consumeFromLoop()) {
      return;
    }
  }
}

bool StreamConnection::feedForTesting(
    const char* data,
    size_t size,
    std::vector<int> fds) {
  if (state_ == State::kHandshake || state_ == State::kConnecting) {
    openChannels(expectedPeerId_);
    std::lock_guard<std::mutex> lock(writeMutex_);
    peerId_ = expectedPeerId_;
    state_ = State::kReady;
  }
  receivedFds_.insert(receivedFds_.end(), fds.begin(), fds.end());
  if (receivedFds_.size() > maxPendingFds_ || fds.size() > maxFdsPerFrame_) {
    rejectFromLoop("peer sent unexpected file descriptors");
    return false;
  }
  if (!staging_) {
    staging_.reset(new char[kStagingBytes]);
  }
  while (size > 0 && state_ != State::kClosed) {
    if (stagedBegin_ == stagedEnd_) {
      stagedBegin_ = stagedEnd_ = 0;
    }
    size_t take = std::min(size, kStagingBytes - stagedEnd_);
    if (take == 0) {
      return false; // unreachable: consumeFromLoop() drains what it can
    }
    std::memcpy(staging_.get() + stagedEnd_, data, take);
    stagedEnd_ += take;
    data += take;
    size -= take;
    if (!consumeFromLoop()) {
      break;
    }
  }
  return state_ != State::kClosed;
}

bool StreamConnection::consumeFromLoop() {
  while (stagedBegin_ < stagedEnd_ && state_ != State::kClosed) {
    size_t avail = stagedEnd_ - stagedBegin_;
    const char* src = staging_.get() + stagedBegin_;
    if (phase_ == ReadPhase::kHeader) {
      size_t take = std::min(avail, sizeof(header_) - phaseFilled_);
      std::memcpy(reinterpret_cast<char*>(&header_) + phaseFilled_, src, take);
      phaseFilled_ += take;
      stagedBegin_ += take;
      if (phaseFilled_ == sizeof(header_) && !onHeaderFromLoop()) {
        return false;
      }
    } else if (phase_ == ReadPhase::kLengthsAndHead) {
      size_t take = std::min(avail, lengthsAndHead_.size() - phaseFilled_);
      std::memcpy(lengthsAndHead_.data() + phaseFilled_, src, take);
      phaseFilled_ += take;
      stagedBegin_ += take;
      if (phaseFilled_ == lengthsAndHead_.size() &&
          !onLengthsAndHeadFromLoop()) {
        return false;
      }
    } else if (!bytesInline()) {
      // A record: the bytes travel out of band; the channel places them.
      size_t take = std::min(avail, sizeof(record_) - recordFilled_);
      std::memcpy(reinterpret_cast<char*>(&record_) + recordFilled_, src, take);
      recordFilled_ += take;
      stagedBegin_ += take;
      if (recordFilled_ == sizeof(record_) && !placeRecordFromLoop()) {
        return false;
      }
    } else {
      size_t want = segmentSizes_[segmentIndex_] - segmentFilled_;
      size_t take = std::min(avail, want);
      char* dst = inlineTargetFromLoop();
      if (dst == nullptr) {
        return false;
      }
      std::memcpy(dst, src, take);
      stagedBegin_ += take;
      if (!inlineArrivedFromLoop(take)) {
        return false;
      }
    }
  }
  return state_ != State::kClosed;
}

bool StreamConnection::placeRecordFromLoop() {
  channel::InboundSegment segment = inboundSegment();
  int64_t placed = channels_[carried() - 1]->onRecordFromLoop(record_, segment);
  if (placed < 0 && state_ != State::kClosed) {
    rejectFromLoop("rejected frame: a record its channel refused");
  }
  if (placed < 0 || state_ == State::kClosed) {
    return false;
  }
  if (placed == 0) {
    // Its bytes come another way (a lane): read nothing more, not even the
    // socket, until the channel says they are in (resumeReadsFromLoop()).
    std::lock_guard<std::mutex> lock(writeMutex_);
    recordHeld_ = true;
    if (registered_) {
      loop_.modify(fd_, readEvents() | (wantWrite_ ? uint32_t(EPOLLOUT) : 0u));
    }
    return false;
  }
  recordFilled_ = 0;
  if (uint64_t(placed) > segmentSizes_[segmentIndex_] - segmentFilled_) {
    rejectFromLoop("rejected frame: record overruns its segment");
    return false;
  }
  advanceSegmentFromLoop(static_cast<size_t>(placed));
  return state_ != State::kClosed;
}

bool StreamConnection::socketAddresses(
    sockaddr_storage* local,
    sockaddr_storage* peer) const {
  socklen_t localLen = sizeof(*local);
  socklen_t peerLen = sizeof(*peer);
  if (fd_ < 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(local), &localLen) != 0 ||
      ::getpeername(fd_, reinterpret_cast<sockaddr*>(peer), &peerLen) != 0) {
    return false;
  }
  return (local->ss_family == AF_INET || local->ss_family == AF_INET6) &&
      local->ss_family == peer->ss_family;
}

channel::InboundSegment StreamConnection::inboundSegment() {
  size_t i = segmentIndex_;
  bool region = !inbound_.provided.empty();
  channel::InboundSegment segment{
      segmentSizes_[i],
      segmentFilled_,
      inbound_.segments[i],
      region ? &inbound_.provided[i] : nullptr,
      region ? &inbound_.regions[i] : nullptr};
  if (i < inbound_.devices.size()) {
    segment.device = inbound_.devices[i];
  }
  return segment;
}

char* StreamConnection::inlineTargetFromLoop() {
  uint8_t slot = carried();
  if (slot == 0) {
    return static_cast<char*>(inbound_.segments[segmentIndex_]) +
        segmentFilled_;
  }
  // A staging channel's segment: it says where the bytes land, once (a read
  // that found nothing at the segment's start comes back here).
  if (landing_ == nullptr) {
    channel::InboundSegment segment = inboundSegment();
    landing_ = channels_[slot - 1]->landFromLoop(segment);
    if (landing_ == nullptr) {
      if (state_ != State::kClosed) {
        rejectFromLoop("rejected frame: a staged segment with nowhere to land");
      }
      return nullptr;
    }
  }
  return landing_ + segmentFilled_;
}

bool StreamConnection::inlineArrivedFromLoop(size_t n) {
  uint8_t slot = carried();
  if (slot != 0) {
    channel::InboundSegment segment = inboundSegment();
    if (!channels_[slot - 1]->landedFromLoop(segment, segmentFilled_ + n)) {
      if (state_ != State::kClosed) {
        rejectFromLoop("rejected frame: a staged segment its channel refused");
      }
      return false;
    }
    if (segmentFilled_ + n == segmentSizes_[segmentIndex_]) {
      landing_ = nullptr;
    }
  }
  advanceSegmentFromLoop(n);
  return state_ != State::kClosed;
}

void StreamConnection::skipEmptySegments() {
  while (segmentIndex_ < segmentSizes_.size() &&
         segmentSizes_[segmentIndex_] == 0) {
    ++segmentIndex_;
  }
}

void StreamConnection::finishFrameFromLoop() {
  phase_ = ReadPhase::kHeader;
  if (bodyOnSocket_) {
    watchSocketBodyFromLoop(false); // the ring again (ringStash_ first)
  }
  for (const auto& channel : channels_) {
    if (!channel->onFrameEndFromLoop()) {
      return; // rejected: the connection is closing
    }
  }
  auto buffers = std::move(inbound_);
  inbound_ = frame::InboundBuffers{};
  observer_->onFrame(shared_from_this(), std::move(head_), std::move(buffers));
}

} // namespace torch_rpc_ext::transport::stream
