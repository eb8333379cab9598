// SPDX-License-Identifier: BSD-3-Clause
// The read side of TcpConnection: the incremental frame parser. Runs on the
// loop thread only; validates each header before allocating anything behind it.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "csrc/common/logging.h"
#include "csrc/transport/tcp/connection.h"

namespace torch_rpc_ext::transport::tcp {

namespace {

constexpr size_t kDirectReadBytes = 16 * 1024;
// An shm connection receives descriptors only with a kRing frame (two: the
// peer's ring and its eventfd) or a kSlab frame (one memfd), and the kernel
// stops each read at a message that carries some, so no more than this many
// can be waiting for their frame. Anything more is an attack on our
// descriptor table.
constexpr size_t kMaxPendingFds = 3;
// A kSlabRelease frame names at most this many bytes of slab ids.
constexpr uint32_t kMaxReleaseHead = 4096;

} // namespace

ssize_t TcpConnection::readFromLoop(void* dst, size_t size) {
  while (true) {
    ssize_t got;
    if (shm_) {
      // recvmsg, not read: read(2) would silently drop passed descriptors.
      iovec iov{dst, size};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      got = ::recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
      if (got >= 0) {
        for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
             c = CMSG_NXTHDR(&msg, c)) {
          if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < n; ++i) {
              int fd;
              std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
              receivedFds_.push_back(fd);
            }
          }
        }
        if ((msg.msg_flags & MSG_CTRUNC) != 0 ||
            receivedFds_.size() > kMaxPendingFds) {
          rejectFromLoop("peer sent unexpected file descriptors");
          return -1;
        }
      }
    } else {
      got = ::read(fd_, dst, size);
    }
    if (got > 0) {
      noteActivity();
      return got;
    }
    if (got == 0) {
      closeInternal("peer closed the connection", false);
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

void TcpConnection::advanceSegmentFromLoop(size_t bytes) {
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

void TcpConnection::onReadableFromLoop() {
  while (state_ != State::kClosed) {
    // Large remainders of a segment go straight into its final buffer.
    if (phase_ == ReadPhase::kSegments && stagedBegin_ == stagedEnd_ &&
        !isRingSegment() && !isSlabSegment()) {
      size_t want = segmentSizes_[segmentIndex_] - segmentFilled_;
      if (want >= kDirectReadBytes) {
        char* dst =
            static_cast<char*>(inbound_.segments[segmentIndex_]) + segmentFilled_;
        ssize_t got = readFromLoop(dst, want);
        if (got <= 0) {
          return;
        }
        advanceSegmentFromLoop(static_cast<size_t>(got));
        continue;
      }
    }
    if (stagedBegin_ == stagedEnd_) {
      stagedBegin_ = stagedEnd_ = 0;
    }
    ssize_t got = readFromLoop(
        staging_.data() + stagedEnd_, staging_.size() - stagedEnd_);
    if (got <= 0) {
      return;
    }
    stagedEnd_ += static_cast<size_t>(got);
    if (!consumeFromLoop()) {
      return;
    }
  }
}

bool TcpConnection::consumeFromLoop() {
  while (stagedBegin_ < stagedEnd_ && state_ != State::kClosed) {
    size_t avail = stagedEnd_ - stagedBegin_;
    const char* src = staging_.data() + stagedBegin_;
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
    } else if (isSlabSegment()) {
      // A SlabRecord: the bytes are in a shared slab already.
      size_t take = std::min(avail, sizeof(slabRecord_) - slabRecordFilled_);
      std::memcpy(
          reinterpret_cast<char*>(&slabRecord_) + slabRecordFilled_, src, take);
      slabRecordFilled_ += take;
      stagedBegin_ += take;
      if (slabRecordFilled_ == sizeof(slabRecord_)) {
        slabRecordFilled_ = 0;
        if (!onSlabRecordFromLoop()) {
          return false;
        }
      }
    } else if (isRingSegment()) {
      // A ChunkRecord: its bytes wait in the peer's ring.
      size_t take = std::min(avail, sizeof(record_) - recordFilled_);
      std::memcpy(reinterpret_cast<char*>(&record_) + recordFilled_, src, take);
      recordFilled_ += take;
      stagedBegin_ += take;
      if (recordFilled_ == sizeof(record_)) {
        recordFilled_ = 0;
        char* dst = static_cast<char*>(inbound_.segments[segmentIndex_]) +
            segmentFilled_;
        std::string why = ringIn_.consume(
            record_, dst, segmentSizes_[segmentIndex_] - segmentFilled_);
        if (!why.empty()) {
          rejectFromLoop("rejected frame: " + why);
          return false;
        }
        advanceSegmentFromLoop(record_.length);
      }
    } else {
      size_t want = segmentSizes_[segmentIndex_] - segmentFilled_;
      size_t take = std::min(avail, want);
      std::memcpy(
          static_cast<char*>(inbound_.segments[segmentIndex_]) + segmentFilled_,
          src,
          take);
      stagedBegin_ += take;
      advanceSegmentFromLoop(take);
    }
  }
  return state_ != State::kClosed;
}

bool TcpConnection::onHeaderFromLoop() {
  std::string why = validateHeader(header_, options_.limits);
  auto kind = static_cast<FrameKind>(header_.kind);
  if (why.empty()) {
    State s = state_;
    bool ok = false;
    if (s == State::kHandshake) {
      ok = kind == handshake_.expectedKind() &&
          header_.headLength == handshake_.expectedHeadBytes();
    } else if (s == State::kReady) {
      ok = kind == FrameKind::kMessage || kind == FrameKind::kPing ||
          kind == FrameKind::kPong ||
          (kind == FrameKind::kRing && shm_ && !ringIn_.valid() &&
           header_.headLength == sizeof(uint64_t)) ||
          (kind == FrameKind::kSlab && shm_ &&
           header_.headLength == sizeof(uint32_t) + sizeof(uint64_t)) ||
          (kind == FrameKind::kSlabRelease && shm_ &&
           header_.headLength >= sizeof(uint32_t) &&
           header_.headLength <= kMaxReleaseHead &&
           header_.headLength % sizeof(uint32_t) == 0) ||
          (kind == FrameKind::kSlabDrop && shm_ &&
           header_.headLength == sizeof(uint32_t));
    }
    if (!ok) {
      why = "unexpected frame kind " + std::to_string(header_.kind) +
          " of head " + std::to_string(header_.headLength) +
          " bytes in this connection state";
    } else if (kind != FrameKind::kMessage && header_.numSegments != 0) {
      why = "control frame with segments";
    } else if (
        header_.flags == kFlagRingSegments && !(shm_ && ringIn_.valid())) {
      why = "ring segments on a connection without a shared ring";
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

bool TcpConnection::onLengthsAndHeadFromLoop() {
  size_t n = header_.numSegments;
  segmentSizes_.resize(n);
  ringSegments_.clear();
  if (header_.flags == kFlagRingSegments) {
    ringSegments_.resize(n);
  }
  slabSegments_.clear();
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(&segmentSizes_[i], lengthsAndHead_.data() + 8 * i, 8);
    if ((segmentSizes_[i] & kSlabSegmentBit) != 0) {
      segmentSizes_[i] &= ~kSlabSegmentBit;
      if (!shm_ || segmentSizes_[i] == 0 ||
          (segmentSizes_[i] & kRingSegmentBit) != 0) {
        rejectFromLoop("rejected frame: bad slab segment length");
        return false;
      }
      slabSegments_.resize(n);
      slabSegments_[i] = true;
    } else if ((segmentSizes_[i] & kRingSegmentBit) != 0) {
      segmentSizes_[i] &= ~kRingSegmentBit;
      if (ringSegments_.empty() || segmentSizes_[i] == 0) {
        rejectFromLoop("rejected frame: bad ring segment length");
        return false;
      }
      ringSegments_[i] = true;
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
  auto kind = static_cast<FrameKind>(header_.kind);
  if (kind != FrameKind::kMessage) {
    // A control frame is done once its head is in.
    phase_ = ReadPhase::kHeader;
    switch (kind) {
      case FrameKind::kPing:
        queueControl(uint8_t(FrameKind::kPong), {});
        return state_ != State::kClosed;
      case FrameKind::kRing:
        return onRingSetupFromLoop();
      case FrameKind::kSlab:
        return onSlabSetupFromLoop();
      case FrameKind::kSlabRelease:
        return onSlabReleaseFromLoop();
      case FrameKind::kSlabDrop:
        return onSlabDropFromLoop();
      default: // kPong; onHeaderFromLoop let no other kind through
        return true;
    }
  }
  try {
    // (slabSegments_ is empty for a frame without slab segments.)
    inbound_ = observer_->onFrameHead(*this, head_, segmentSizes_, slabSegments_);
  } catch (const std::exception& e) {
    rejectFromLoop(std::string("rejected frame: ") + e.what());
    return false;
  }
  if (inbound_.segments.size() != n) {
    rejectFromLoop("rejected frame: receiver gave wrong buffer count");
    return false;
  }
  if (!slabSegments_.empty()) {
    inbound_.provided.assign(n, nullptr);
    inbound_.regions.assign(n, nullptr);
  }
  slabRecordFilled_ = 0;
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

bool TcpConnection::onRingSetupFromLoop() {
  if (receivedFds_.size() != 2) {
    rejectFromLoop("rejected frame: ring setup without its descriptors");
    return false;
  }
  uint64_t capacity;
  std::memcpy(&capacity, head_.data(), sizeof(capacity));
  int memFd = receivedFds_[0];
  int wakeFd = receivedFds_[1];
  receivedFds_.clear();
  std::string why = shm::Ring::attach(memFd, wakeFd, capacity, &ringIn_);
  if (!why.empty()) {
    rejectFromLoop("rejected ring: " + why);
    return false;
  }
  return true;
}

void TcpConnection::skipEmptySegments() {
  while (segmentIndex_ < segmentSizes_.size() &&
         segmentSizes_[segmentIndex_] == 0) {
    ++segmentIndex_;
  }
}

void TcpConnection::finishFrameFromLoop() {
  phase_ = ReadPhase::kHeader;
  auto buffers = std::move(inbound_);
  inbound_ = InboundBuffers{};
  observer_->onFrame(shared_from_this(), std::move(head_), std::move(buffers));
}

} // namespace torch_rpc_ext::transport::tcp
