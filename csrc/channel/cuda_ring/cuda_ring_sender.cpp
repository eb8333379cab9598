// SPDX-License-Identifier: BSD-3-Clause
// cuda_ring (cuda_ring_channel.h), sending: the ring, the copies out of the
// device into its slots, and the records put in the stream once they have
// completed.
#include <algorithm>
#include <cstring>
#include <mutex>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/engines.h"
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

// When the last ring failed to be made or pinned in this process (steady
// clock ticks; 0: never): for a minute after, segments go to cuda_staged at
// once rather than each paying for a ring that will fail again.
std::atomic<int64_t> ringFailedAt{0};
constexpr std::chrono::seconds kRingRetryAfter{60};

bool ringFailedRecently() {
  const int64_t at = ringFailedAt.load(std::memory_order_relaxed);
  return at != 0 &&
      std::chrono::steady_clock::now() -
          std::chrono::steady_clock::time_point(
              std::chrono::steady_clock::duration(at)) <
      kRingRetryAfter;
}

} // namespace

// A segment on its way out. At the send, its bytes are copied on the
// caller's stream into a block of the device's pool (a strided view packed
// as it is copied): the value at the time of the send travels, whatever the
// caller queues there afterwards, and the caller's stream never waits for
// the ring. Once that copy has completed (readyBytes() is then its size;
// until then its frame does not start), the block is copied into slots
// chunk by chunk as the stream asks for them.
class RingOut final : public StagedOut {
 public:
  struct Chunk {
    uint32_t slot;
    uint64_t offset;
    uint32_t bytes;
  };

  RingOut(
      std::weak_ptr<RingChannel> channel,
      const frame::OutboundFrame::Segment& segment,
      StagingPool& pool,
      std::shared_ptr<StagingPool::Block> block,
      PooledEvent snapshot)
      : channel_(std::move(channel)),
        device_(segment.deviceIndex),
        base_(static_cast<const char*>(segment.data)),
        size_(segment.size),
        pool_(pool),
        block_(std::move(block)),
        snapshot_(std::move(snapshot)) {}
  ~RingOut() override {
    if (auto ch = channel_.lock()) {
      ch->forget(*this);
    }
    // The block goes back once the snapshot and every copy out of it are
    // done (the next copy into it waits for its lastUse on the device).
    if (!sourceReady_.load(std::memory_order_acquire)) {
      // Dropped (its frame failed or its connection closed) before the
      // snapshot was known done, so no copy out of it started: the block
      // goes back once the snapshot has run. A wait for it on the device's
      // copy-out stream, which every connection's chunks share, would hold
      // them all behind the caller's stream, for good if that never drains.
      StagingPool* pool = &pool_;
      whenComplete(
          device_,
          snapshot_,
          [pool, block = std::move(block_)](const std::string& error) mutable {
            if (error.empty()) {
              pool->giveBlock(std::move(block));
            } // else kept, not reused: the snapshot may still write it
          });
      return;
    }
    try {
      CurrentDevice current(device_);
      CUstream out = outStream(device_);
      TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, out, snapshot_.get(), 0);
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block_->lastUse, out);
      block_->used = true;
      pool_.giveBlock(std::move(block_));
    } catch (const std::exception& e) {
      logWarning(
          std::string(
              "torch_rpc_ext: cuda_ring keeps a block it could not "
              "give back: ") +
          e.what());
    }
  }
  // The segment's own address (the stream passes it back plus the offset).
  const char* data() const override {
    return base_;
  }
  uint64_t readyBytes() const override {
    return sourceReady_.load(std::memory_order_acquire) ? size_ : 0;
  }
  void markSourceReady() {
    sourceReady_.store(true, std::memory_order_release);
  }
  CUdeviceptr source() const {
    return block_->address;
  }

  const std::weak_ptr<RingChannel> channel_;
  const int device_;
  const char* const base_;
  const uint64_t size_;
  // The channel's mutex_ guards these.
  std::vector<Chunk> chunks_; // copying or copied, not yet sent, in order
  uint64_t copiedTo_ = 0; // bytes whose copy has started

 private:
  StagingPool& pool_;
  std::shared_ptr<StagingPool::Block> block_;
  const PooledEvent snapshot_; // recorded after the copy into block_
  std::atomic<bool> sourceReady_{false};
};

bool RingChannel::takeChunks(
    const frame::OutboundFrame::Segment& segment,
    std::shared_ptr<StagedOut>* staged) {
  if (segment.device != uint8_t(DeviceKind::kCuda) ||
      segment.size < kRingMinSegment || segment.deviceIndex < 0 ||
      ringFailedRecently()) {
    return false; // cuda_staged gathers the small ones
  }
  if (auto host = host_.lock(); !host || host->isClosed()) {
    return false; // no ring made for a connection that closed meanwhile
  }
  const int device = segment.deviceIndex;
  bool haveRing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    haveRing = out_ != nullptr;
    used_ = std::chrono::steady_clock::now(); // not idle: it will be used
    // From here, not once the segment is set up: an idle drop on the loop
    // meanwhile (used_ is no guard at an idle time of 0, or behind a slow
    // setup) would leave its frame a chunk with no ring to carry it.
    ++outs_;
  }
  // Declined below: the ring no longer waits for this segment.
  auto decline = [this] {
    std::lock_guard<std::mutex> lock(mutex_);
    --outs_;
    counters_.declined++;
  };
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
      ring->pin(device);
    } catch (const std::exception& e) {
      ringFailedAt.store(
          std::chrono::steady_clock::now().time_since_epoch().count(),
          std::memory_order_relaxed);
      decline();
      logWarning(
          std::string(
              "torch_rpc_ext: cuda_ring made no ring (cuda_staged "
              "carries large CUDA tensors on one host for a "
              "minute): ") +
          e.what());
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto host = host_.lock(); !host || host->isClosed()) {
      // Closed meanwhile: onClosedFromLoop() takes mutex_ after the close,
      // so a ring installed here would outlive its sweep.
      --outs_;
      counters_.declined++;
      return false; // the ring's last holder frees it off the loop
    }
    if (!out_) {
      out_ = std::move(ring);
      announce_ = true;
      slots_.assign(out_->slots(), Slot::kFree);
      sentCount_.assign(out_->slots(), 0);
      counters_.created++;
    }
  }
  // The snapshot, on the caller's stream after its work there.
  auto& pool = StagingPool::of(device);
  std::shared_ptr<StagingPool::Block> block;
  PooledEvent snapshot;
  const auto stream = reinterpret_cast<CUstream>(segment.stream);
  try {
    CurrentDevice current(device);
    block = pool.takeBlock(segment.size);
    if (block->used) {
      TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, block->lastUse, 0);
    }
    // A received tensor sent on: its memory is read on `stream` now.
    if (auto* origin =
            dynamic_cast<frame::DeviceRegion*>(segment.origin.get())) {
      origin->recordUse(segment.stream);
    }
    const auto src = reinterpret_cast<CUdeviceptr>(segment.data);
    if (segment.view) {
      copyEngine(device).pack(
          stream,
          block->address,
          src,
          segment.view->sizes,
          segment.view->strides,
          segment.view->elementSize);
    } else {
      TORCH_RPC_EXT_CUDA_CHECK(
          cuMemcpyAsync, block->address, src, segment.size, stream);
    }
    snapshot = pool.takeEvent();
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, snapshot.get(), stream);
  } catch (const std::exception& e) {
    if (block) {
      try {
        // A copy into it may have been queued: it goes back after it.
        CurrentDevice current(device);
        TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block->lastUse, stream);
        block->used = true;
        pool.giveBlock(std::move(block));
      } catch (const std::exception&) {
        // Kept, not reused: a copy may still write it.
      }
    }
    decline();
    logDebug(
        std::string("torch_rpc_ext: cuda_ring declined a segment: ") +
        e.what());
    return false;
  }
  // (Its end gives back the count taken above: the ring stays while a
  // segment may still use it.)
  auto out = std::make_shared<RingOut>(
      shared_from_this(), segment, pool, std::move(block), snapshot);
  std::weak_ptr<RingOut> weakOut = out;
  std::weak_ptr<RingChannel> weak = shared_from_this();
  whenComplete(
      device,
      std::move(snapshot),
      [weakOut, weak, device](const std::string& error) {
        auto self = weak.lock();
        if (!error.empty()) {
          if (self) {
            self->failFromStagingThread(
                "copying a segment on cuda:" + std::to_string(device) +
                " failed: " + error);
          }
          return;
        }
        if (auto o = weakOut.lock()) {
          o->markSourceReady();
        }
        if (self) {
          self->wakeWriter();
        }
      });
  counters_.sent++;
  counters_.sentBytes += segment.size;
  *staged = std::move(out);
  return true;
}

void RingChannel::failFromStagingThread(const std::string& why) {
  if (auto host = host_.lock()) {
    std::weak_ptr<Host> weakHost = host;
    host->post([weakHost, why] {
      if (auto h = weakHost.lock()) {
        h->rejectFromLoop("cuda_ring: " + why);
      }
    });
  }
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
      {ring->memFd(), ring->peerWakeFd()},
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
    const int device = out.device_;
    // Taken before the copy: nothing between the copy and its completion's
    // hold on the ring may fail but the record itself.
    auto copied = StagingPool::of(device).takeEvent();
    {
      CurrentDevice current(out.device_);
      out_->pin(out.device_); // (a ring made for another device's segment)
      TORCH_RPC_EXT_CUDA_CHECK(
          cuMemcpyDtoHAsync,
          out_->slot(slot),
          out.source() + out.copiedTo_,
          n,
          stream);
    }
    *free = Slot::kCopying;
    out.chunks_.push_back({slot, out.copiedTo_, static_cast<uint32_t>(n)});
    out.copiedTo_ += n;
    counters_.chunks++;
    // Its completion comes back to the loop (never runs here: mutex_ held).
    std::weak_ptr<RingChannel> weak = shared_from_this();
    auto ring = out_; // the mapping outlives the copy, whatever closes
    const uint64_t generation = out_->generation();
    recordOrHold(device, copied, stream, ring);
    whenComplete(
        device,
        std::move(copied),
        [weak, ring, generation, slot, device](const std::string& error) {
          auto self = weak.lock();
          if (!self) {
            return;
          }
          if (!error.empty()) {
            // Its bytes will never be in the slot: the frame cannot go.
            self->failFromStagingThread(
                "copying a chunk out of cuda:" + std::to_string(device) +
                " failed: " + error);
            return;
          }
          if (auto host = self->host_.lock()) {
            host->post([weak, generation, slot] {
              if (auto s = weak.lock()) {
                s->onCopiedFromLoop(generation, slot);
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
  --outs_;
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
    if (!out_ || outs_ > 0 ||
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
    auto h = self->host_.lock();
    SignalDrain drain = self->watched_->drainWakeups();
    if (drain != SignalDrain::kOpen) {
      // Shut down by the receiver (it reads as ended on every pass of the
      // loop from now on) or used to pass descriptors: forget it and end
      // the connection.
      if (h) {
        h->unwatchFromLoop(self->watched_->wakeFd());
      }
      self->watched_.reset();
      if (h) {
        h->rejectFromLoop(
            std::string("the peer ") + signalMisuseText(drain) +
            " its cuda_ring wake-up socket");
      }
      return;
    }
    if (h) {
      h->resumeWritesFromLoop(); // produceChunkLocked() reclaims the slots
    }
  });
}

void RingChannel::retire(std::shared_ptr<RingMemory> ring) {
  // The loop forgets the wake-up socket before the ring (and its
  // descriptors) goes.
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
