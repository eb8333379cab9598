// SPDX-License-Identifier: BSD-3-Clause
// cuda_staged (staged_channel.h), sending: device bytes staged through
// pinned host memory (a frame's small segments gathered by one launch), and
// the thread that lets the stream write each chunk once its copy has
// completed.
#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "csrc/channel/cuda/copy_engine.h"
#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/channel/cuda/staging_pool.h"
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
  void raiseReady(uint64_t bytes) {
    uint64_t cur = ready_.load(std::memory_order_relaxed);
    while (
        cur < bytes &&
        !ready_.compare_exchange_weak(cur, bytes, std::memory_order_release)) {
    }
  }
  char* buffer() {
    return buffer_.data;
  }

 private:
  StagingPool& pool_;
  const StagingPool::HostBuffer buffer_;
  std::atomic<uint64_t> ready_{0};
};

// The one thread that watches the copies out of devices and lets each
// connection write what became ready. It polls their events (cuEventQuery:
// a stream stuck behind the caller's work holds back only its own chunks,
// and no thread spins inside the driver), sleeping longer while nothing
// completes, and trims the staging pools now and then (freeing memory may
// wait for the device: never on a transport loop). Leaked with the process.
class StagingThread {
 public:
  struct Item {
    int device;
    PooledEvent copied;
    std::shared_ptr<StagedBytes> staged;
    uint64_t readyAfter;
    std::weak_ptr<Host> host;
    // Instead of a chunk: what to run, on this thread, once `copied` has
    // completed (releaseAfter()).
    std::function<void()> done;
  };

  static StagingThread& get() {
    static StagingThread* t = new StagingThread();
    return *t;
  }

  void add(Item item) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_one();
  }

 private:
  StagingThread() : thread_([this] { run(); }) {
    thread_.detach();
  }

  void run() {
    pthread_setname_np(pthread_self(), "rpcext-staging");
    using std::chrono::microseconds;
    std::vector<Item> pending;
    auto pause = microseconds(20);
    auto lastTrim = std::chrono::steady_clock::now();
    while (true) {
      // At exit (ExitGate: Python's atexit, before the driver shuts down)
      // the thread stops for good: a trim or a query after the driver's own
      // exit handler would fail (CUDA_ERROR_DEINITIALIZED) and say so.
      ExitGate::parkIfClosed();
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (pending.empty() && queue_.empty()) {
          // Idle: wake for new work, or to trim the pools.
          cv_.wait_for(lock, std::chrono::milliseconds(kStagedIdleMs / 5));
        } else if (queue_.empty()) {
          cv_.wait_for(lock, pause);
        }
        for (auto& item : queue_) {
          pending.push_back(std::move(item));
        }
        queue_.clear();
      }
      ExitGate::parkIfClosed(); // (the wait may have outlasted the gate)
      ExitGate::Busy busy;
      bool progressed = false;
      for (size_t i = 0; i < pending.size();) {
        if (!poll(pending[i])) {
          ++i;
          continue;
        }
        progressed = true;
        pending[i] = std::move(pending.back());
        pending.pop_back();
      }
      pause = progressed ? microseconds(20)
                         : std::min(pause * 2, microseconds(1000));
      auto now = std::chrono::steady_clock::now();
      if (now - lastTrim > std::chrono::milliseconds(kStagedIdleMs / 5)) {
        lastTrim = now;
        try {
          StagingPool::trimAll();
        } catch (const CudaError& e) {
          if (e.code() != CUDA_ERROR_DEINITIALIZED) { // exiting: not an error
            logWarning(
                std::string(
                    "torch_rpc_ext: cuda_staged could not free idle "
                    "memory: ") +
                e.what());
          }
        } catch (const std::exception& e) {
          logWarning(
              std::string(
                  "torch_rpc_ext: cuda_staged could not free idle "
                  "memory: ") +
              e.what());
        }
      }
    }
  }

  // Whether `item` is done with (its copy completed, or failed).
  static bool poll(Item& item) {
    std::string error;
    try {
      CurrentDevice current(item.device);
      CUresult rc = libcuda().cuEventQuery(item.copied.get());
      if (rc == CUDA_ERROR_NOT_READY) {
        return false;
      }
      checkCuda("cuEventQuery", rc);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (item.done) {
      // Also on an error: a failed stream reads nothing more.
      item.copied.reset();
      auto done = std::move(item.done);
      try {
        done();
      } catch (const std::exception& e) {
        logWarning(
            std::string("torch_rpc_ext: releasing after a CUDA copy threw: ") +
            e.what());
      }
      return true;
    }
    if (error.empty()) {
      // Chunks of one segment complete in order on its stream, but may be
      // seen out of order here: the mark only moves forward.
      item.staged->raiseReady(item.readyAfter);
    }
    item.copied.reset();
    item.staged.reset();
    auto host = item.host.lock();
    if (!host) {
      return true;
    }
    std::weak_ptr<Host> weak = host;
    host->post([weak, error, device = item.device] {
      auto h = weak.lock();
      if (!h) {
        return;
      }
      if (error.empty()) {
        h->resumeWritesFromLoop();
      } else {
        // Its bytes will never be ready: the frame cannot be written.
        h->rejectFromLoop(
            "cuda_staged: copying a segment out of cuda:" +
            std::to_string(device) + " failed: " + error);
      }
    });
    return true;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::thread thread_;
};

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

 private:
  const std::shared_ptr<StagedBytes> whole_;
  const uint64_t offset_;
  const uint64_t size_;
};

uint64_t aligned(uint64_t n) {
  return (n + kStagedAlign - 1) / kStagedAlign * kStagedAlign;
}

} // namespace

void releaseAfter(int device, CUstream stream, std::function<void()> release) {
  PooledEvent done;
  try {
    CurrentDevice current(device);
    done = StagingPool::of(device).takeEvent();
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, done.get(), stream);
  } catch (const std::exception&) {
    // No event: wait for the stream here (what it failed with, the stream's
    // next use reports), so that nothing it still reads goes first.
    {
      CurrentDevice current(device);
      libcuda().cuStreamSynchronize(stream);
    }
    release();
    return;
  }
  StagingThread::get().add(
      {device, std::move(done), nullptr, 0, {}, std::move(release)});
}

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
      StagingThread::get().add(
          {device, std::move(copied), whole, at + n, host_});
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
      StagingThread::get().add(
          {segment.deviceIndex, std::move(copied), staged, at + n, host_});
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
