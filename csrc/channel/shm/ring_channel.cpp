// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/shm/ring_channel.h"

#include <algorithm>
#include <cstring>

#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::shm {

namespace {

using frame::FrameKind;
using frame::SegmentRecord;

// The ring takes a chunked segment in chunks of at most this many bytes.
constexpr size_t kRingChunk = 256 * 1024;

} // namespace

RingChannel::RingChannel(
    std::shared_ptr<const Context> context,
    std::weak_ptr<Host> host,
    RingCounters& counters)
    : Channel(std::move(context)),
      host_(std::move(host)),
      counters_(counters) {}

bool RingChannel::takeChunks(
    const frame::OutboundFrame::Segment& segment,
    std::shared_ptr<StagedOut>* /*staged*/) {
  if (segment.size < kSlabMinSegment) {
    return false; // the stream is cheaper
  }
  const bool warm = offers_.offerIsWarm();
  bool haveRing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    haveRing = out_ != nullptr;
    if (haveRing) {
      used_ = std::chrono::steady_clock::now(); // not idle: it will be used
    } else if (!warm) {
      // A one-off: a new ring would cost more than it saves.
      counters_.oneOffs.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
  }
  if (!haveRing && !makeFirstRing()) {
    return false; // no shared memory now: the stream takes the segment
  }
  counters_.segments.fetch_add(1, std::memory_order_relaxed);
  counters_.bytes.fetch_add(segment.size, std::memory_order_relaxed);
  return true;
}

bool RingChannel::makeFirstRing() {
  // Made here, with no lock held, so that a failure declines the segment
  // rather than failing its frame; announced by prepareChunksLocked().
  auto ring = std::make_shared<Ring>();
  try {
    *ring = Ring::create(kInitialRingBytes);
  } catch (const std::exception& e) {
    logDebug(
        std::string(
            "torch_rpc_ext: no shared-memory ring, the stream takes "
            "the segment: ") +
        e.what());
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!out_) {
    out_ = std::move(ring);
    filled_ = false;
    announce_ = true;
    used_ = std::chrono::steady_clock::now();
    counters_.created.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

ControlFrame RingChannel::setupFrame(const std::shared_ptr<Ring>& ring) {
  if (auto host = host_.lock()) {
    std::weak_ptr<RingChannel> weak = shared_from_this();
    host->post([weak, ring] {
      if (auto self = weak.lock()) {
        self->watchFromLoop(ring);
      }
    });
  }
  uint64_t cap = ring->capacity();
  // The descriptors live as long as the ring; the frame keeps it alive.
  return ControlFrame{
      context().wireIds().kind(kRingSetup),
      std::string(reinterpret_cast<const char*>(&cap), sizeof(cap)),
      {ring->fd(), ring->peerWakeFd()},
      ring};
}

std::optional<ControlFrame> RingChannel::prepareChunksLocked() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (announce_) {
    announce_ = false;
    return setupFrame(out_);
  }
  uint64_t capacity = kInitialRingBytes;
  if (out_) {
    // Grow only if the ring filled up since it was made. The new ring is a
    // new file: bytes of the old one still waiting for the peer stay valid
    // in its mapping, and the peer switches rings only after the last
    // record naming the old one (stream order).
    if (!filled_ || out_->capacity() >= kLargestRingBytes) {
      return std::nullopt;
    }
    capacity = std::min(kLargestRingBytes, out_->capacity() * 4);
  }
  auto ring = std::make_shared<Ring>();
  try {
    *ring = Ring::create(capacity);
  } catch (const std::exception& e) {
    if (out_) {
      return std::nullopt; // keep the ring we have
    }
    // No ring at all: produceChunkLocked() fails the frame, naming this.
    logWarning(std::string("torch_rpc_ext: shared-memory ring: ") + e.what());
    filled_ = false;
    return std::nullopt;
  }
  counters_.created.fetch_add(1, std::memory_order_relaxed);
  if (out_) {
    retire(std::move(out_));
  }
  out_ = ring;
  filled_ = false;
  used_ = std::chrono::steady_clock::now();
  return setupFrame(ring);
}

size_t RingChannel::produceChunkLocked(
    const char* data,
    size_t size,
    StagedOut* /*staged*/,
    SegmentRecord* record,
    std::string* error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!out_) {
    *error = "no shared-memory ring could be created for a large segment";
    return 0;
  }
  ChunkRecord chunk{};
  size_t n = out_->produce(data, size, kRingChunk, &chunk, error);
  if (n == 0 && error->empty()) {
    // Full: the consumer is behind. The next frame starts on a larger ring.
    filled_ = true;
    counters_.fullWaits.fetch_add(1, std::memory_order_relaxed);
  }
  used_ = std::chrono::steady_clock::now();
  static_assert(sizeof(chunk) == sizeof(*record));
  std::memcpy(record, &chunk, sizeof(chunk));
  return n;
}

std::optional<ControlFrame> RingChannel::dropIfIdleLocked() {
  std::shared_ptr<Ring> dropped;
  bool announced;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!out_ || !out_->drained() ||
        std::chrono::steady_clock::now() - used_ <
            std::chrono::milliseconds(kIdleRingMs)) {
      return std::nullopt;
    }
    dropped = std::move(out_);
    out_.reset();
    filled_ = false;
    announced = !announce_;
    announce_ = false;
  }
  counters_.dropped.fetch_add(1, std::memory_order_relaxed);
  if (!announced) {
    return std::nullopt; // the peer never heard of it (its frame never went)
  }
  retire(std::move(dropped));
  // Queued after every record that names the ring (they are all on the
  // wire: the caller checked that no queued frame uses the ring).
  return ControlFrame{context().wireIds().kind(kRingDrop), {}, {}, nullptr};
}

void RingChannel::onWakeFromLoop() {
  auto host = host_.lock();
  SignalDrain drain = watched_ ? watched_->drainWakeups() : SignalDrain::kOpen;
  if (drain != SignalDrain::kOpen) {
    // The consumer shut its end down (an honest one only closes it, and we
    // hold that end open too: the socket would read as ended on every pass
    // of the loop) or passed descriptors over it. Forget it and end the
    // connection.
    if (host) {
      host->unwatchFromLoop(watched_->wakeFd());
    }
    watched_.reset();
    if (host) {
      host->rejectFromLoop(
          std::string("the peer ") + signalMisuseText(drain) +
          " its shm_ring wake-up socket");
    }
    return;
  }
  if (host) {
    host->resumeWritesFromLoop();
  }
}

void RingChannel::watchFromLoop(const std::shared_ptr<Ring>& ring) {
  auto host = host_.lock();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!host || host->isClosed() || out_ != ring) {
      return; // closed, or already replaced or dropped
    }
  }
  if (watched_) {
    host->unwatchFromLoop(watched_->wakeFd());
  }
  watched_ = ring;
  std::weak_ptr<RingChannel> weak = shared_from_this();
  host->watchFromLoop(ring->wakeFd(), [weak] {
    if (auto self = weak.lock()) {
      self->onWakeFromLoop();
    }
  });
  // A wake-up that came before we watched is still pending in the socket
  // (level-triggered), so nothing is missed.
}

void RingChannel::retire(std::shared_ptr<Ring> ring) {
  // The loop forgets the socket before the ring (and its descriptors) goes:
  // a descriptor closed while watched could be reused and then unwatched.
  auto host = host_.lock();
  if (!host) {
    return;
  }
  std::weak_ptr<RingChannel> weak = shared_from_this();
  host->post([weak, ring = std::move(ring)] {
    auto self = weak.lock();
    if (self && self->watched_ == ring) {
      if (auto h = self->host_.lock()) {
        h->unwatchFromLoop(ring->wakeFd());
      }
      self->watched_.reset();
    }
  });
}

void RingChannel::onClosedFromLoop() {
  if (watched_) {
    if (auto host = host_.lock()) {
      host->unwatchFromLoop(watched_->wakeFd());
    }
    watched_.reset();
  }
  // Both rings unmapped now, not when the connection goes: a request still
  // served for the peer holds it (and this channel) as long as it runs.
  ringIn_ = Ring();
  std::lock_guard<std::mutex> lock(mutex_);
  out_.reset(); // its socket is not watched (above): nothing can be reused
}

int64_t RingChannel::onRecordFromLoop(
    const SegmentRecord& record,
    InboundSegment& segment) {
  auto host = host_.lock();
  ChunkRecord chunk;
  static_assert(sizeof(chunk) == sizeof(record));
  std::memcpy(&chunk, &record, sizeof(chunk));
  std::string why;
  if (!ringIn_.valid()) {
    why = "ring chunk without a ring";
  } else {
    why = ringIn_.consume(
        chunk,
        static_cast<char*>(segment.buffer) + segment.filled,
        segment.size - segment.filled);
  }
  if (!why.empty()) {
    if (host) {
      host->rejectFromLoop("rejected frame: " + why);
    }
    return -1;
  }
  return static_cast<int64_t>(chunk.length);
}

bool RingChannel::acceptsControlFrame(FrameKind kind, uint32_t headLength)
    const {
  switch (context().wireIds().offsetOf(kind)) {
    case kRingSetup:
      return headLength == sizeof(uint64_t);
    case kRingDrop:
      return headLength == 0;
    default:
      return false;
  }
}

bool RingChannel::onControlFrameFromLoop(
    FrameKind kind,
    const std::string& head,
    std::vector<int>& fds) {
  auto host = host_.lock();
  if (!host) {
    return false;
  }
  if (context().wireIds().offsetOf(kind) == kRingDrop) {
    if (!ringIn_.valid()) {
      host->rejectFromLoop(
          "rejected frame: the peer dropped a ring it never set up");
      return false;
    }
    ringIn_ = Ring();
    return true;
  }
  if (fds.size() < 2) {
    host->rejectFromLoop("rejected frame: ring setup without its descriptors");
    return false;
  }
  uint64_t capacity;
  std::memcpy(&capacity, head.data(), sizeof(capacity));
  // Its two from the front: descriptors of a later frame (another
  // channel's setup read in the same call) may follow.
  int memFd = fds[0];
  int wakeFd = fds[1];
  fds.erase(fds.begin(), fds.begin() + 2);
  // Replaces the peer's last ring, if any: every record naming that one
  // came before this frame and has been consumed.
  Ring ring;
  std::string why = Ring::attach(memFd, wakeFd, capacity, &ring);
  if (!why.empty()) {
    host->rejectFromLoop("rejected ring: " + why);
    return false;
  }
  ringIn_ = std::move(ring);
  return true;
}

} // namespace torch_rpc_ext::channel::shm
