// SPDX-License-Identifier: BSD-3-Clause
// cuda_staged (staged_channel.h), sending: device bytes staged through
// pinned host memory (a frame's small segments gathered by one launch),
// each chunk written once the staging thread (cuda/staging_thread.h) has
// seen its copy complete.
#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <vector>

#include "csrc/channel/cuda/copy_engine.h"
#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/channel/cuda/staging_thread.h"
#include "csrc/channel/cuda_staged/staged_channel.h"
#include "csrc/common/exit_gate.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

// A segment on its way out: pinned memory filled chunk by chunk. Given back
// to the pool when the frame is done with it and its last copy has
// completed (the staging thread holds it until then).
class StagedBytes final : public StagedOut {
 public:
  StagedBytes(StagingPool& pool, StagingPool::HostBuffer buffer)
      : pool_(pool), buffer_(buffer) {}
  ~StagedBytes() override {
    pool_.giveHost(buffer_);
  }
  const char* data() const override {
    return buffer_.data;
  }
  uint64_t readyBytes() const override {
    return ready_.load(std::memory_order_acquire);
  }
  bool failed() const override {
    return failed_.load(std::memory_order_acquire);
  }
  void waitReady(uint64_t end, std::chrono::microseconds timeout)
      const override {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_for(
        lock, timeout, [&] { return readyBytes() >= end || failed(); });
  }
  void markFailed() {
    failed_.store(true, std::memory_order_release);
    notify();
  }
  void raiseReady(uint64_t bytes) {
    uint64_t cur = ready_.load(std::memory_order_relaxed);
    while (
        cur < bytes &&
        !ready_.compare_exchange_weak(cur, bytes, std::memory_order_release)) {
    }
    notify();
  }
  char* buffer() {
    return buffer_.data;
  }

 private:
  StagingPool& pool_;
  const StagingPool::HostBuffer buffer_;
  // Wakes a lane thread waiting for the mark (waitReady); taken only to
  // notify, so that a wait cannot miss a raise between its check and sleep.
  void notify() {
    {
      std::lock_guard<std::mutex> lock(mu_);
    }
    changed_.notify_all();
  }

  std::atomic<uint64_t> ready_{0};
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  mutable std::condition_variable changed_;
};

// What follows the copy out of a segment's bytes up to `readyAfter`: the
// connection may write them; where the copy failed, it must close (they will
// never be ready).
std::function<void(const std::string&)> chunkReady(
    std::shared_ptr<StagedBytes> staged,
    uint64_t readyAfter,
    std::weak_ptr<Host> host) {
  return [staged = std::move(staged), readyAfter, host = std::move(host)](
             const std::string& error) {
    if (error.empty()) {
      // Chunks of one segment complete in order on its stream, but may be
      // seen out of order here: the mark only moves forward.
      staged->raiseReady(readyAfter);
    } else {
      staged->markFailed(); // (a lane thread may be waiting: it stops)
    }
    auto h = host.lock();
    if (!h) {
      return;
    }
    std::weak_ptr<Host> weak = h;
    h->post([weak, error] {
      auto h = weak.lock();
      if (!h) {
        return;
      }
      if (error.empty()) {
        h->resumeWritesFromLoop();
      } else {
        h->rejectFromLoop(
            "cuda_staged: copying a segment out of its device failed: " +
            error);
      }
    });
  };
}

// One segment of a gathered buffer: its bytes are ready as far as the
// buffer's are past its offset.
class StagedSlice final : public StagedOut {
 public:
  StagedSlice(
      std::shared_ptr<StagedBytes> whole,
      uint64_t offset,
      uint64_t size)
      : whole_(std::move(whole)), offset_(offset), size_(size) {}
  const char* data() const override {
    return whole_->data() + offset_;
  }
  uint64_t readyBytes() const override {
    const uint64_t ready = whole_->readyBytes();
    return ready <= offset_ ? 0 : std::min(size_, ready - offset_);
  }
  bool failed() const override {
    return whole_->failed();
  }
  void waitReady(uint64_t end, std::chrono::microseconds timeout)
      const override {
    whole_->waitReady(offset_ + end, timeout);
  }

 private:
  const std::shared_ptr<StagedBytes> whole_;
  const uint64_t offset_;
  const uint64_t size_;
};

uint64_t aligned(uint64_t n) {
  return (n + kStagedAlign - 1) / kStagedAlign * kStagedAlign;
}

} // namespace

void StagedChannel::stageOutAll(
    const std::vector<frame::OutboundFrame::Segment>& segments,
    const std::vector<size_t>& offered,
    std::vector<std::shared_ptr<StagedOut>>& staged) {
  // Small contiguous segments of one device and stream: gathered, if two or
  // more; every other one on its own.
  std::vector<bool> done(offered.size(), false);
  std::vector<size_t> group;
  for (size_t first = 0; first < offered.size(); ++first) {
    if (done[first]) {
      continue;
    }
    const auto& lead = segments[offered[first]];
    auto small = [&](const frame::OutboundFrame::Segment& s) {
      return s.device == uint8_t(DeviceKind::kCuda) && s.deviceIndex >= 0 &&
          s.size > 0 && s.size <= kGatherMaxBytes && !s.view;
    };
    group.clear();
    if (small(lead)) {
      for (size_t j = first; j < offered.size(); ++j) {
        const auto& s = segments[offered[j]];
        if (!done[j] && small(s) && s.deviceIndex == lead.deviceIndex &&
            s.stream == lead.stream) {
          done[j] = true;
          group.push_back(offered[j]);
        }
      }
    }
    if (group.size() >= 2) {
      gatherOut(segments, group, staged);
    } else {
      done[first] = true;
      staged[offered[first]] = stageOut(lead);
    }
  }
}

void StagedChannel::gatherOut(
    const std::vector<frame::OutboundFrame::Segment>& segments,
    const std::vector<size_t>& group,
    std::vector<std::shared_ptr<StagedOut>>& staged) {
  const auto& lead = segments[group.front()];
  const int device = lead.deviceIndex;
  uint64_t total = 0;
  uint64_t bytes = 0;
  for (size_t i : group) {
    total += aligned(segments[i].size);
    bytes += segments[i].size;
  }
  StagingPool& pool = StagingPool::of(device);
  std::string why;
  auto buffer = pool.takeHost(total, &why);
  if (buffer.data == nullptr) {
    counters_.declined++;
    throw std::runtime_error(why);
  }
  auto whole = std::make_shared<StagedBytes>(pool, buffer);
  CurrentDevice current(device);
  const auto stream = reinterpret_cast<CUstream>(lead.stream);
  for (size_t i : group) {
    if (auto* origin =
            dynamic_cast<frame::DeviceRegion*>(segments[i].origin.get())) {
      origin->recordUse(segments[i].stream);
    }
  }
  std::shared_ptr<StagingPool::Block> block;
  try {
    // One launch gathers them into a block of the pool, after the caller's
    // work on `stream` and the block's last use...
    block = pool.takeBlock(total);
    if (block->used) {
      TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, block->lastUse, 0);
    }
    std::vector<CopyEngine::Segment> rows;
    rows.reserve(group.size());
    uint64_t offset = 0;
    for (size_t i : group) {
      rows.push_back(
          {block->address + offset,
           reinterpret_cast<CUdeviceptr>(segments[i].data),
           segments[i].size});
      offset += aligned(segments[i].size);
    }
    copyEngine(device).copySegments(stream, rows);
    // ... which goes out chunk by chunk, as one segment's bytes do.
    for (uint64_t at = 0; at < total; at += kStagedChunkBytes) {
      uint64_t n = std::min<uint64_t>(kStagedChunkBytes, total - at);
      TORCH_RPC_EXT_CUDA_CHECK(
          cuMemcpyDtoHAsync,
          whole->buffer() + at,
          block->address + at,
          n,
          stream);
      auto copied = pool.takeEvent();
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, copied.get(), stream);
      whenComplete(device, std::move(copied), chunkReady(whole, at + n, host_));
      counters_.chunks++;
    }
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block->lastUse, stream);
    block->used = true;
    pool.giveBlock(std::move(block));
  } catch (...) {
    // As stageOut(): nothing may still write into what goes back.
    libcuda().cuStreamSynchronize(stream);
    if (block) {
      block->used = false;
      pool.giveBlock(std::move(block));
    }
    throw;
  }
  uint64_t offset = 0;
  for (size_t i : group) {
    staged[i] = std::make_shared<StagedSlice>(whole, offset, segments[i].size);
    offset += aligned(segments[i].size);
  }
  counters_.sent += group.size();
  counters_.sentBytes += bytes;
  counters_.gathered += group.size();
}

std::shared_ptr<StagedOut> StagedChannel::stageOut(
    const frame::OutboundFrame::Segment& segment) {
  if (segment.device != uint8_t(DeviceKind::kCuda) || segment.deviceIndex < 0 ||
      segment.size == 0) {
    return nullptr;
  }
  StagingPool& pool = StagingPool::of(segment.deviceIndex);
  std::string why;
  auto buffer = pool.takeHost(segment.size, &why);
  if (buffer.data == nullptr) {
    counters_.declined++;
    throw std::runtime_error(why);
  }
  auto staged = std::make_shared<StagedBytes>(pool, buffer);
  CurrentDevice current(segment.deviceIndex);
  const auto stream = reinterpret_cast<CUstream>(segment.stream);
  auto src = reinterpret_cast<CUdeviceptr>(segment.data);
  // A received tensor sent on: its memory is read on `stream` now.
  if (auto* origin = dynamic_cast<frame::DeviceRegion*>(segment.origin.get())) {
    origin->recordUse(segment.stream);
  }
  // A strided view is packed on the device first, into a block of the
  // pool's that goes back once the copies out of it are done.
  std::shared_ptr<StagingPool::Block> packed;
  auto givePacked = [&] {
    if (packed) {
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, packed->lastUse, stream);
      packed->used = true;
      pool.giveBlock(std::move(packed));
    }
  };
  // Chunk by chunk on the stream the bytes are ready on: the stream writes
  // the first chunk while the next ones are still copying.
  try {
    if (segment.view) {
      packed = pool.takeBlock(segment.size);
      if (packed->used) {
        TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, packed->lastUse, 0);
      }
      copyEngine(segment.deviceIndex)
          .pack(
              stream,
              packed->address,
              src,
              segment.view->sizes,
              segment.view->strides,
              segment.view->elementSize);
      src = packed->address;
      counters_.packed++;
    }
    for (uint64_t at = 0; at < segment.size; at += kStagedChunkBytes) {
      uint64_t n = std::min<uint64_t>(kStagedChunkBytes, segment.size - at);
      TORCH_RPC_EXT_CUDA_CHECK(
          cuMemcpyDtoHAsync, staged->buffer() + at, src + at, n, stream);
      auto copied = pool.takeEvent();
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, copied.get(), stream);
      whenComplete(
          segment.deviceIndex,
          std::move(copied),
          chunkReady(staged, at + n, host_));
      counters_.chunks++;
    }
    givePacked();
  } catch (...) {
    // A copy queued without an event to follow may still write into the
    // buffer: it must not go back to the pool before that copy is done (a
    // host wait, on this failing path only).
    libcuda().cuStreamSynchronize(stream);
    if (packed) {
      packed->used = false; // nothing of the stream uses it any more
      pool.giveBlock(std::move(packed));
    }
    throw;
  }
  counters_.sent++;
  counters_.sentBytes += segment.size;
  return staged;
}

} // namespace torch_rpc_ext::channel::cuda
