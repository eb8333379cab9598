// SPDX-License-Identifier: BSD-3-Clause
// The read side of StreamConnection: the incremental frame parser. Runs on the
// loop thread only; validates each header before allocating anything behind
// it, and leaves what only a channel knows (its control frames, the records
// of out-of-band segments) to the connection's channels.
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

bool StreamConnection::onHeaderFromLoop() {
  std::string why = frame::validateHeader(header_, options_.limits);
  const auto* raw = reinterpret_cast<const unsigned char*>(&header_);
  if (!why.empty() && state_ == State::kHandshake && !tls_ && raw[0] == 0x16 &&
      raw[1] == 0x03) {
    // A TLS handshake record (type 22, version 3.x) where a hello belongs.
    rejectFromLoop(
        "the peer began a TLS handshake: it encrypts this connection and "
        "this end does not (set the same `encryption` on every worker; "
        "\"auto\" encrypts only peers whose address is not loopback)");
    return false;
  }
  auto kind = static_cast<frame::FrameKind>(header_.kind);
  if (why.empty()) {
    State s = state_;
    bool ok = false;
    if (s == State::kHandshake) {
      ok = kind == handshake_.expectedKind() &&
          header_.headLength == handshake_.expectedHeadBytes();
    } else if (s == State::kReady) {
      ok = kind == frame::FrameKind::kMessage ||
          kind == frame::FrameKind::kPing || kind == frame::FrameKind::kPong ||
          (kind == frame::FrameKind::kFrameRing && passesDescriptors() &&
           header_.headLength == sizeof(uint64_t)) ||
          (kind > frame::FrameKind::kPong &&
           std::any_of(channels_.begin(), channels_.end(), [&](const auto& c) {
             return c->acceptsControlFrame(kind, header_.headLength);
           }));
    }
    if (!ok) {
      why = "unexpected frame kind " + std::to_string(header_.kind) +
          " of head " + std::to_string(header_.headLength) +
          " bytes in this connection state";
    } else if (kind != frame::FrameKind::kMessage && header_.numSegments != 0) {
      why = "control frame with segments";
    } else if (
        (header_.flags == frame::kFlagCarrier ||
         header_.flags == frame::kFlagBodyOnSocket) &&
        !inRing_) {
      why = "a frame ring's flag on a connection without one";
    } else if (
        header_.flags == frame::kFlagChunkedSegments &&
        std::none_of(channels_.begin(), channels_.end(), [](const auto& c) {
          return c->context().mode() == channel::Channel::Mode::kChunks &&
              c->acceptsRecords();
        })) {
      why = "chunked segments on a connection without a chunk channel";
    }
  }
  if (!why.empty()) {
    rejectFromLoop("rejected frame: " + why);
    return false;
  }
  phaseFilled_ = 0;
  lengthsAndHead_.assign(
      size_t(header_.numSegments) * 8 + header_.headLength, '\0');
  phase_ = ReadPhase::kLengthsAndHead;
  if (lengthsAndHead_.empty()) {
    return onLengthsAndHeadFromLoop();
  }
  return true;
}

bool StreamConnection::onLengthsAndHeadFromLoop() {
  size_t n = header_.numSegments;
  segmentSizes_.resize(n);
  carried_.clear();
  std::vector<bool> provided; // empty unless a region segment is announced
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(&segmentSizes_[i], lengthsAndHead_.data() + 8 * i, 8);
    auto wireId =
        static_cast<uint8_t>(segmentSizes_[i] >> frame::kChannelIdShift);
    if (wireId != 0) {
      segmentSizes_[i] &= frame::kSegmentLengthMask;
      uint8_t slot = channelSlot(wireId);
      if (slot == 0) {
        rejectFromLoop(
            "rejected frame: segment " + std::to_string(i) + " names channel " +
            std::to_string(wireId) + ", which this connection does not use");
        return false;
      }
      auto& ch = *channels_[slot - 1];
      bool chunks = ch.context().mode() == channel::Channel::Mode::kChunks;
      if (segmentSizes_[i] == 0 || !ch.acceptsRecords() ||
          (chunks && header_.flags != frame::kFlagChunkedSegments)) {
        rejectFromLoop("rejected frame: bad record segment length");
        return false;
      }
      carried_.resize(n, 0);
      carried_[i] = slot;
      if (!chunks || ch.context().device() != channel::DeviceKind::kCpu) {
        // The channel provides the memory (a device channel's chunks land
        // in device memory of its own, as a region's bytes do).
        provided.resize(n);
        provided[i] = true;
      }
    }
    if (segmentSizes_[i] > header_.dataLength - sum) {
      rejectFromLoop("rejected frame: segment lengths exceed dataLength");
      return false;
    }
    sum += segmentSizes_[i];
  }
  if (sum != header_.dataLength) {
    rejectFromLoop("rejected frame: segment lengths do not sum to dataLength");
    return false;
  }
  head_ = lengthsAndHead_.substr(n * 8);
  lengthsAndHead_.clear();
  phaseFilled_ = 0;
  if (state_ != State::kReady) {
    phase_ = ReadPhase::kHeader;
    return onHandshakeFrameFromLoop(std::move(head_));
  }
  auto kind = static_cast<frame::FrameKind>(header_.kind);
  if (kind != frame::FrameKind::kMessage) {
    // A control frame is done once its head is in.
    phase_ = ReadPhase::kHeader;
    if (!takeCarrierFromLoop()) {
      return false;
    }
    if (kind == frame::FrameKind::kPing) {
      queueControl(uint8_t(frame::FrameKind::kPong), {});
      return state_ != State::kClosed;
    }
    if (kind == frame::FrameKind::kPong) {
      return true;
    }
    if (kind == frame::FrameKind::kFrameRing) {
      return onFrameRingFromLoop();
    }
    for (auto& ch : channels_) {
      if (ch->acceptsControlFrame(kind, header_.headLength)) {
        if (!ch->onControlFrameFromLoop(kind, head_, receivedFds_) &&
            state_ != State::kClosed) {
          rejectFromLoop("rejected frame: a control frame its channel refused");
        }
        return state_ != State::kClosed;
      }
    }
    return true; // unreachable: onHeaderFromLoop() let no other kind in
  }
  if (!takeCarrierFromLoop() ||
      (header_.flags == frame::kFlagBodyOnSocket &&
       !beginSocketBodyFromLoop())) {
    return false;
  }
  try {
    inbound_ = observer_->onFrameHead(*this, head_, segmentSizes_, provided);
  } catch (const std::exception& e) {
    rejectFromLoop(std::string("rejected frame: ") + e.what());
    return false;
  }
  if (inbound_.segments.size() != n) {
    rejectFromLoop("rejected frame: receiver gave wrong buffer count");
    return false;
  }
  if (!provided.empty()) {
    inbound_.provided.assign(n, nullptr);
    inbound_.regions.assign(n, nullptr);
  }
  recordFilled_ = 0;
  segmentIndex_ = 0;
  segmentFilled_ = 0;
  skipEmptySegments();
  if (segmentIndex_ == n) {
    finishFrameFromLoop();
  } else {
    phase_ = ReadPhase::kSegments;
  }
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
