// SPDX-License-Identifier: BSD-3-Clause
// cuda_ring (cuda_ring_channel.h), sending: the ring, the copies out of the
// device into its slots, and the records put in the stream once they have
// completed.
#include <algorithm>
#include <cstring>
#include <mutex>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/channel/cuda/staging_thread.h"
#include "csrc/channel/cuda_ring/cuda_ring_channel.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

// The stream copies out of `device` run on, made once per device (a copy
// onto the device, cuda_staged's and our receiving side's, runs on the
// pool's stream: both directions' copy engines stay busy).
CUstream outStream(int device) {
  static std::mutex mu;
  static std::vector<CUstream> streams;
  std::lock_guard<std::mutex> lock(mu);
  if (streams.size() <= size_t(device)) {
    streams.resize(device + 1, nullptr);
  }
  if (streams[device] == nullptr) {
    CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(
        cuStreamCreate, &streams[device], CU_STREAM_NON_BLOCKING);
  }
  return streams[device];
}

} // namespace

// A segment on its way out: copied into slots chunk by chunk as the stream
// asks for them. Its bytes are ready at the source (readyBytes() is its
// size) once the caller's stream has passed the send; until then its frame
// does not start.
class RingOut final : public StagedOut {
 public:
  struct Chunk {
    uint32_t slot;
    uint64_t offset;
    uint32_t bytes;
  };

  RingOut(
      std::weak_ptr<RingChannel> channel,
      const frame::OutboundFrame::Segment& segment)
      : channel_(std::move(channel)),
        device_(segment.deviceIndex),
        base_(static_cast<const char*>(segment.data)),
        size_(segment.size) {}
  ~RingOut() override {
    if (auto ch = channel_.lock()) {
      ch->forget(*this);
    }
  }
  const char* data() const override {
    return base_;
  }
  uint64_t readyBytes() const override {
    return sourceReady_.load(std::memory_order_acquire) ? size_ : 0;
  }
  void markSourceReady() {
    sourceReady_.store(true, std::memory_order_release);
  }

  const std::weak_ptr<RingChannel> channel_;
  const int device_;
  const char* const base_; // device memory
  const uint64_t size_;
  // The channel's mutex_ guards these.
  std::vector<Chunk> chunks_; // copying or copied, not yet sent, in order
  uint64_t copiedTo_ = 0; // bytes whose copy has started

 private:
  std::atomic<bool> sourceReady_{false};
};

bool RingChannel::takeChunks(
    const frame::OutboundFrame::Segment& segment,
    std::shared_ptr<StagedOut>* staged) {
  if (segment.device != uint8_t(DeviceKind::kCuda) ||
      segment.size < kRingMinSegment || segment.view != nullptr ||
      segment.deviceIndex < 0) {
    return false; // cuda_staged gathers the small ones and packs views
  }
  bool haveRing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    haveRing = out_ != nullptr;
    used_ = std::chrono::steady_clock::now(); // not idle: it will be used
  }
  if (!haveRing) {
    // Made and pinned here, with no lock held: a failure declines the
    // segment (cuda_staged takes it) rather than failing its frame.
    std::shared_ptr<RingMemory> ring;
    try {
      uint64_t generation;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        generation = nextGeneration_++;
      }
      ring = RingMemory::create(generation, kRingSlots, kRingSlotBytes);
      ring->pin(segment.deviceIndex);
    } catch (const std::exception& e) {
      counters_.declined++;
      logDebug(
          std::string(
              "torch_rpc_ext: cuda_ring made no ring, cuda_staged "
              "takes the segment: ") +
          e.what());
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!out_) {
      out_ = std::move(ring);
      announce_ = true;
      slots_.assign(out_->slots(), Slot::kFree);
      sentCount_.assign(out_->slots(), 0);
      counters_.created++;
    }
  }
  auto out = std::make_shared<RingOut>(shared_from_this(), segment);
  // The copies out start only once the caller's stream has passed the send
  // (on our own stream: the caller's may be long busy by then).
  std::weak_ptr<RingOut> weakOut = out;
  std::weak_ptr<RingChannel> weak = shared_from_this();
  releaseAfter(
      segment.deviceIndex,
      reinterpret_cast<CUstream>(segment.stream),
      [weakOut, weak] {
        if (auto o = weakOut.lock()) {
          o->markSourceReady();
        }
        if (auto self = weak.lock()) {
          self->wakeWriter();
        }
      });
  counters_.sent++;
  counters_.sentBytes += segment.size;
  *staged = std::move(out);
  return true;
}

void RingChannel::wakeWriter() {
  if (auto host = host_.lock()) {
    std::weak_ptr<Host> weakHost = host;
    host->post([weakHost] {
      if (auto h = weakHost.lock()) {
        h->resumeWritesFromLoop();
      }
    });
  }
}

std::optional<ControlFrame> RingChannel::prepareChunksLocked() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!announce_ || !out_) {
    return std::nullopt;
  }
  announce_ = false;
  auto ring = out_;
  if (auto host = host_.lock()) {
    std::weak_ptr<RingChannel> weak = shared_from_this();
    host->post([weak, ring] {
      if (auto self = weak.lock()) {
        self->watchFromLoop(ring);
      }
    });
  }
  RingSetup setup{ring->generation(), ring->slots(), 0, ring->slotBytes()};
  // The frame keeps the ring (and so its descriptors) until it is written.
  return ControlFrame{
      context().wireIds().kind(kRingSetup),
      std::string(reinterpret_cast<const char*>(&setup), sizeof(setup)),
      {ring->memFd(), ring->wakeFd()},
      ring};
}

void RingChannel::reclaimLocked() {
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i] == Slot::kSent && out_->released(i) >= sentCount_[i]) {
      slots_[i] = Slot::kFree;
    }
  }
}

void RingChannel::startCopiesLocked(RingOut& out) {
  while (out.copiedTo_ < out.size_) {
    auto free = std::find(slots_.begin(), slots_.end(), Slot::kFree);
    if (free == slots_.end()) {
      if (out.chunks_.empty()) {
        counters_.slotWaits++;
      }
      return; // the receiver's next release wakes the writer
    }
    const auto slot = static_cast<uint32_t>(free - slots_.begin());
    const uint64_t n =
        std::min<uint64_t>(out_->slotBytes(), out.size_ - out.copiedTo_);
    CUstream stream = outStream(out.device_);
    {
      CurrentDevice current(out.device_);
      out_->pin(out.device_); // (a ring made for another device's segment)
      TORCH_RPC_EXT_CUDA_CHECK(
          cuMemcpyDtoHAsync,
          out_->slot(slot),
          reinterpret_cast<CUdeviceptr>(out.base_ + out.copiedTo_),
          n,
          stream);
    }
    *free = Slot::kCopying;
    out.chunks_.push_back({slot, out.copiedTo_, static_cast<uint32_t>(n)});
    out.copiedTo_ += n;
    counters_.chunks++;
    // Its completion comes back to the loop (never runs here: mutex_ held).
    std::weak_ptr<RingChannel> weak = shared_from_this();
    std::weak_ptr<Host> weakHost = host_;
    auto ring = out_; // the mapping outlives the copy, whatever closes
    const uint64_t generation = out_->generation();
    releaseAfter(out.device_, stream, [weak, weakHost, ring, generation, slot] {
      if (auto h = weakHost.lock()) {
        h->post([weak, generation, slot] {
          if (auto self = weak.lock()) {
            self->onCopiedFromLoop(generation, slot);
          }
        });
      }
    });
  }
}

void RingChannel::onCopiedFromLoop(uint64_t generation, uint32_t slot) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!out_ || out_->generation() != generation || slot >= slots_.size()) {
      return;
    }
    if (slots_[slot] == Slot::kOrphan) {
      slots_[slot] = Slot::kFree; // its segment's frame went without it
    } else if (slots_[slot] == Slot::kCopying) {
      slots_[slot] = Slot::kCopied;
    }
  }
  if (auto host = host_.lock()) {
    host->resumeWritesFromLoop();
  }
}

size_t RingChannel::produceChunkLocked(
    const char* data,
    size_t size,
    StagedOut* staged,
    frame::SegmentRecord* record,
    std::string* error) {
  auto* out = dynamic_cast<RingOut*>(staged);
  std::lock_guard<std::mutex> lock(mutex_);
  if (out == nullptr || !out_) {
    *error = "cuda_ring: a chunk with no ring to carry it";
    return 0;
  }
  used_ = std::chrono::steady_clock::now();
  const auto offset = static_cast<uint64_t>(data - out->base_);
  try {
    reclaimLocked();
    startCopiesLocked(*out);
  } catch (const std::exception& e) {
    *error = std::string("cuda_ring: copying out of the device: ") + e.what();
    return 0;
  }
  if (out->chunks_.empty()) {
    return 0; // every slot is in use: a release wakes the writer
  }
  const RingOut::Chunk chunk = out->chunks_.front();
  if (chunk.offset != offset || chunk.bytes > size) {
    *error = "cuda_ring: chunks out of order";
    return 0;
  }
  if (slots_[chunk.slot] != Slot::kCopied) {
    return 0; // its copy completing wakes the writer
  }
  out->chunks_.erase(out->chunks_.begin());
  slots_[chunk.slot] = Slot::kSent;
  sentCount_[chunk.slot]++;
  SlotRecord r{out_->generation(), chunk.slot, chunk.bytes};
  static_assert(sizeof(r) == sizeof(*record));
  std::memcpy(record, &r, sizeof(r));
  return chunk.bytes;
}

void RingChannel::forget(RingOut& out) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& chunk : out.chunks_) {
    if (chunk.slot >= slots_.size()) {
      continue;
    }
    // A copy still running frees its slot when it completes.
    slots_[chunk.slot] =
        slots_[chunk.slot] == Slot::kCopying ? Slot::kOrphan : Slot::kFree;
  }
  out.chunks_.clear();
}

std::optional<ControlFrame> RingChannel::dropIfIdleLocked() {
  std::shared_ptr<RingMemory> dropped;
  bool announced;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!out_ ||
        std::chrono::steady_clock::now() - used_ <
            std::chrono::milliseconds(ringIdleMs())) {
      return std::nullopt;
    }
    reclaimLocked();
    if (std::any_of(slots_.begin(), slots_.end(), [](Slot s) {
          return s != Slot::kFree;
        })) {
      return std::nullopt; // the receiver still copies out of a slot
    }
    dropped = std::move(out_);
    out_.reset();
    announced = !announce_;
    announce_ = false;
    slots_.clear();
    sentCount_.clear();
  }
  counters_.dropped++;
  if (!announced) {
    return std::nullopt; // the peer never heard of it
  }
  const uint64_t generation = dropped->generation();
  retire(std::move(dropped));
  return ControlFrame{
      context().wireIds().kind(kRingDrop),
      std::string(reinterpret_cast<const char*>(&generation), 8),
      {},
      nullptr};
}

void RingChannel::watchFromLoop(const std::shared_ptr<RingMemory>& ring) {
  auto host = host_.lock();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!host || host->isClosed() || out_ != ring) {
      return; // closed, or already dropped
    }
  }
  if (watched_) {
    host->unwatchFromLoop(watched_->wakeFd());
  }
  watched_ = ring;
  std::weak_ptr<RingChannel> weak = shared_from_this();
  host->watchFromLoop(ring->wakeFd(), [weak] {
    auto self = weak.lock();
    if (!self || !self->watched_) {
      return;
    }
    self->watched_->drainWakeups();
    if (auto h = self->host_.lock()) {
      h->resumeWritesFromLoop(); // produceChunkLocked() reclaims the slots
    }
  });
}

void RingChannel::retire(std::shared_ptr<RingMemory> ring) {
  // The loop forgets the eventfd before the ring (and its descriptor) goes.
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

} // namespace torch_rpc_ext::channel::cuda
