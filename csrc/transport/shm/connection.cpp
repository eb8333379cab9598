// SPDX-License-Identifier: BSD-3-Clause
// ShmConnection: the hooks of the stream core, and the lazily sized ring.
// Slabs are in connection_slabs.cpp.
#include "csrc/transport/shm/connection.h"

#include <sys/epoll.h>

#include <algorithm>
#include <cstring>

#include "csrc/common/logging.h"

namespace torch_rpc_ext::transport::shm {

namespace {

// The ring takes a chunked segment in chunks of at most this many bytes.
constexpr size_t kRingChunk = 256 * 1024;
// An shm connection receives descriptors only with a kRing frame (two: the
// peer's ring and its eventfd) or a kSlab frame (one memfd), and the kernel
// stops each read at a message that carries some, so no more than this many
// can be waiting for their frame.
constexpr size_t kMaxPendingFds = 3;
// A kSlabRelease frame names at most this many bytes of slab ids.
constexpr uint32_t kMaxReleaseHead = 4096;

// Watches the eventfd of a connection's outbound ring.
class RingWaker final : public stream::Pollable {
 public:
  explicit RingWaker(std::weak_ptr<ShmConnection> conn)
      : conn_(std::move(conn)) {}
  void handleEventsFromLoop(uint32_t /*events*/) override {
    if (auto c = conn_.lock()) {
      c->onRingWakeFromLoop();
    }
  }

 private:
  std::weak_ptr<ShmConnection> conn_;
};

} // namespace

ShmConnection::ShmConnection(
    stream::Loop& loop,
    const TransportOptions& options,
    SlabCounters& counters,
    int fd,
    bool outbound,
    int32_t expectedPeerId,
    std::string peerAddress,
    ConnectionObserver* observer)
    : StreamConnection(
          loop,
          options,
          "shm",
          fd,
          outbound,
          expectedPeerId,
          std::move(peerAddress),
          observer),
      counters_(counters) {}

size_t ShmConnection::maxPendingFds() const {
  return kMaxPendingFds;
}

bool ShmConnection::acceptsControlFrame(FrameKind kind, uint32_t headLength)
    const {
  switch (kind) {
    case FrameKind::kRing:
      return headLength == sizeof(uint64_t);
    case FrameKind::kRingDrop:
      return headLength == 0;
    case FrameKind::kSlab:
      return headLength == sizeof(uint32_t) + sizeof(uint64_t);
    case FrameKind::kSlabRelease:
      return headLength >= sizeof(uint32_t) && headLength <= kMaxReleaseHead &&
          headLength % sizeof(uint32_t) == 0;
    case FrameKind::kSlabDrop:
      return headLength == sizeof(uint32_t);
    default:
      return false;
  }
}

bool ShmConnection::onControlFrameFromLoop(FrameKind kind) {
  switch (kind) {
    case FrameKind::kRing:
      return onRingSetupFromLoop();
    case FrameKind::kRingDrop:
      return onRingDropFromLoop();
    case FrameKind::kSlab:
      return onSlabSetupFromLoop();
    case FrameKind::kSlabRelease:
      return onSlabReleaseFromLoop();
    case FrameKind::kSlabDrop:
      return onSlabDropFromLoop();
    default: // acceptsControlFrame() let no other kind through
      return true;
  }
}

bool ShmConnection::acceptsRecordSegments(uint64_t bit) const {
  // Chunks need the peer's ring, which its kRing frame maps before the
  // first frame that uses it; slab records are checked one by one.
  return bit == kRegionSegmentBit || (bit == kChunkedSegmentBit && ringIn_.valid());
}

int64_t ShmConnection::onSegmentRecordFromLoop(
    uint64_t bit,
    const SegmentRecord& record) {
  if (bit == kRegionSegmentBit) {
    SlabRecord r;
    static_assert(sizeof(r) == sizeof(record));
    std::memcpy(&r, &record, sizeof(r));
    return onSlabRecordFromLoop(r);
  }
  ChunkRecord chunk;
  static_assert(sizeof(chunk) == sizeof(record));
  std::memcpy(&chunk, &record, sizeof(chunk));
  if (!ringIn_.valid()) {
    rejectFromLoop("rejected frame: ring chunk without a ring");
    return -1;
  }
  char* dst =
      static_cast<char*>(inbound_.segments[segmentIndex_]) + segmentFilled_;
  std::string why = ringIn_.consume(
      chunk, dst, segmentSizes_[segmentIndex_] - segmentFilled_);
  if (!why.empty()) {
    rejectFromLoop("rejected frame: " + why);
    return -1;
  }
  return static_cast<int64_t>(chunk.length);
}

void ShmConnection::planFrameSegments(
    OutboundFrame& frame,
    PendingWrite& w,
    std::vector<bool>& region,
    std::vector<PendingWrite>& before) {
  for (size_t i = 0; i < frame.segments.size(); ++i) {
    const auto& segment = frame.segments[i];
    if (segment.size < kSlabMinSegment) {
      continue;
    }
    SlabRecord record{};
    std::shared_ptr<Slab> setup;
    if (prepareSlabSegment(segment, &record, &setup)) {
      if (region.empty()) {
        region.resize(frame.segments.size());
        // Reserved once: the frame's segments will point into it.
        w.regionRecords.reserve(frame.segments.size());
      }
      region[i] = true;
      SegmentRecord r;
      std::memcpy(&r, &record, sizeof(r));
      w.regionRecords.push_back(r);
      if (setup != nullptr) {
        // A new slab reaches the peer before the first record naming it.
        before.push_back(slabSetupFrame(record.id, std::move(setup)));
      }
    } else {
      w.chunked.resize(frame.segments.size());
      w.chunked[i] = true;
    }
  }
}

void ShmConnection::queueBeforeMessageLocked() {
  // Slab releases waiting for a ride take this one.
  if (!pendingReleases_.empty()) {
    queueReleasesLocked();
  }
}

void ShmConnection::onTickFromLoop() {
  // Memory goes back once traffic stops: releases still waiting for a frame
  // to ride with, our free slabs idle for kSlabIdleMs, an idle ring.
  flushReleases();
  trimSlabs();
  dropIdleRingFromLoop();
}

void ShmConnection::onClosedFromLoop() {
  if (ringWatched_) {
    loop_.removeFromLoop(ringWatched_->wakeFd());
    ringWatched_.reset();
  }
}

// ---- Rings ---------------------------------------------------------------

std::optional<ShmConnection::PendingWrite>
ShmConnection::prepareChunkChannelLocked() {
  uint64_t capacity = kInitialRingBytes;
  if (ringOut_) {
    // Grow only if the ring filled up since it was made. The new ring is a
    // new file: bytes of the old one still waiting for the peer stay valid
    // in its mapping, and the peer switches rings only after the last
    // record naming the old one (stream order).
    if (!ringFilled_ || ringOut_->capacity() >= kLargestRingBytes) {
      return std::nullopt;
    }
    capacity = std::min(kLargestRingBytes, ringOut_->capacity() * 4);
  }
  auto ring = std::make_shared<Ring>();
  try {
    *ring = Ring::create(capacity);
  } catch (const std::exception& e) {
    if (ringOut_) {
      return std::nullopt; // keep the ring we have
    }
    // No ring at all: the frame cannot go. Closing names the reason.
    logWarning(std::string("torch_rpc_ext: shared-memory ring: ") + e.what());
    ringFilled_ = false;
    return std::nullopt;
  }
  counters_.ringsCreated.fetch_add(1, std::memory_order_relaxed);
  if (ringOut_) {
    retireRing(std::move(ringOut_));
  }
  ringOut_ = ring;
  ringFilled_ = false;
  ringUsed_ = std::chrono::steady_clock::now();
  std::weak_ptr<ShmConnection> weak =
      std::static_pointer_cast<ShmConnection>(shared_from_this());
  loop_.post([weak, ring] {
    if (auto self = weak.lock()) {
      self->watchRingFromLoop(ring);
    }
  });
  uint64_t cap = ring->capacity();
  PendingWrite w = controlFrame(
      FrameKind::kRing,
      std::string(reinterpret_cast<const char*>(&cap), sizeof(cap)));
  w.passFds = {ring->fd(), ring->wakeFd()};
  // Descriptors live as long as the ring; the frame keeps the ring alive.
  w.frame.keepAlive = ring;
  return w;
}

size_t ShmConnection::produceChunkLocked(
    const char* data,
    size_t size,
    SegmentRecord* record,
    std::string* error) {
  if (!ringOut_) {
    *error = "no shared-memory ring could be created for a large segment";
    return 0;
  }
  ChunkRecord chunk{};
  size_t n = ringOut_->produce(data, size, kRingChunk, &chunk, error);
  if (n == 0 && error->empty()) {
    ringFilled_ = true;
  }
  ringUsed_ = std::chrono::steady_clock::now();
  std::memcpy(record, &chunk, sizeof(chunk));
  return n;
}

void ShmConnection::onRingWakeFromLoop() {
  if (ringWatched_) {
    ringWatched_->drainWakeups();
  }
  chunkChannelFreedFromLoop();
}

void ShmConnection::watchRingFromLoop(const std::shared_ptr<Ring>& ring) {
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed || ringOut_ != ring) {
      return; // closed, or already replaced or dropped
    }
  }
  if (ringWatched_) {
    loop_.removeFromLoop(ringWatched_->wakeFd());
  }
  ringWatched_ = ring;
  loop_.addFromLoop(
      ring->wakeFd(),
      std::make_shared<RingWaker>(
          std::static_pointer_cast<ShmConnection>(shared_from_this())),
      EPOLLIN);
  // A wake-up that came before we watched is still pending in the eventfd
  // (level-triggered), so nothing is missed.
}

void ShmConnection::retireRing(std::shared_ptr<Ring> ring) {
  // The loop forgets the eventfd before the ring (and its descriptors) goes:
  // a descriptor closed while watched could be reused and then unwatched.
  std::weak_ptr<ShmConnection> weak =
      std::static_pointer_cast<ShmConnection>(shared_from_this());
  loop_.post([weak, ring = std::move(ring)] {
    auto self = weak.lock();
    if (self && self->ringWatched_ == ring) {
      self->loop_.removeFromLoop(ring->wakeFd());
      self->ringWatched_.reset();
    }
  });
}

void ShmConnection::dropIdleRingFromLoop() {
  std::shared_ptr<Ring> dropped;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (!ringOut_ || state_ != State::kReady || !ringOut_->drained() ||
        std::chrono::steady_clock::now() - ringUsed_ <
            std::chrono::milliseconds(kIdleRingMs)) {
      return;
    }
    // No queued frame may still mean to use it.
    for (const auto& w : writes_) {
      if (!w.chunked.empty()) {
        return;
      }
    }
    dropped = std::move(ringOut_);
    ringOut_.reset();
    ringFilled_ = false;
    // After every record that names the ring (they are all on the wire).
    writes_.push_back(controlFrame(FrameKind::kRingDrop, {}));
    if (writes_.size() == 1) {
      error = flushLocked();
    }
  }
  counters_.ringsDropped.fetch_add(1, std::memory_order_relaxed);
  retireRing(std::move(dropped));
  afterFlush(error);
}

bool ShmConnection::onRingSetupFromLoop() {
  if (receivedFds_.size() != 2) {
    rejectFromLoop("rejected frame: ring setup without its descriptors");
    return false;
  }
  uint64_t capacity;
  std::memcpy(&capacity, head_.data(), sizeof(capacity));
  int memFd = receivedFds_[0];
  int wakeFd = receivedFds_[1];
  receivedFds_.clear();
  // Replaces the peer's last ring, if any: every record naming that one
  // came before this frame and has been consumed.
  Ring ring;
  std::string why = Ring::attach(memFd, wakeFd, capacity, &ring);
  if (!why.empty()) {
    rejectFromLoop("rejected ring: " + why);
    return false;
  }
  ringIn_ = std::move(ring);
  return true;
}

bool ShmConnection::onRingDropFromLoop() {
  if (!ringIn_.valid()) {
    rejectFromLoop("rejected frame: the peer dropped a ring it never set up");
    return false;
  }
  ringIn_ = Ring();
  return true;
}

} // namespace torch_rpc_ext::transport::shm
