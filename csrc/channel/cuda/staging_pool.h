// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/frame/frame.h"

namespace torch_rpc_ext::channel::cuda {

// What cuda_staged (staged_channel.h) draws on, per device and process:
// pinned host buffers, device blocks, events, and the stream its copies onto
// the device run on. Thread-safe; never waits for the GPU (a buffer or block
// whose last use may still run is reused or freed only once an event says
// it has finished).

// At most this much pinned memory per device is in use at once (both
// directions), and what stays unused this long is freed.
constexpr uint64_t kMaxPinnedBytes = uint64_t(8) << 30;
constexpr int64_t kStagedIdleMs = 5000;

// A CUevent of the pool's, back in the pool when the last holder lets go.
using PooledEvent = std::shared_ptr<CUevent_st>;

class StagingPool {
 public:
  // Pinned host memory (cuMemHostAlloc in the device's context).
  struct HostBuffer {
    char* data = nullptr;
    uint64_t capacity = 0;
  };
  // Device memory the receiver's tensors view (cuMemAlloc). `lastUse` is
  // recorded after the last use of a lent block; the next copy into it
  // waits for that on the device.
  struct Block {
    CUdeviceptr address = 0;
    uint64_t capacity = 0;
    CUevent lastUse = nullptr;
    bool used = false; // lastUse has a record to wait for
  };

  // The pool of `device`, made on first use and kept for the life of the
  // process (as the primary contexts: device.h). Throws naming the device
  // if it does not exist.
  static StagingPool& of(int device);

  int device() const {
    return device_;
  }

  // Pinned memory for `bytes`, or a buffer with no data when the device's
  // pinned memory in use would pass kMaxPinnedBytes (`why` says so).
  HostBuffer takeHost(uint64_t bytes, std::string* why);
  // Back to the pool: nothing uses it any more...
  void giveHost(HostBuffer buffer);
  // ... or once `after` has completed (copies still reading or writing it).
  void retireHost(HostBuffer buffer, PooledEvent after);

  std::shared_ptr<Block> takeBlock(uint64_t bytes);
  // A block nothing uses on the host any more: its lastUse is recorded (or
  // it was never used).
  void giveBlock(std::shared_ptr<Block> block);
  // ... or one whose lastUse may never complete (what was to land in it
  // had not when it died: its copy in may wait on a dead peer's record):
  // reused only once lastUse has completed, so that no copy into it waits
  // behind that (as torch's caching allocator reuses a block only once
  // its streams' events have completed).
  void retireBlock(std::shared_ptr<Block> block);

  PooledEvent takeEvent();
  // The stream copies onto the device run on (non-blocking, made once).
  CUstream copyStream();
  // A block for `bytes` that copies on copyStream() may overwrite: that
  // stream waits for the block's last use first (a landing's block).
  std::shared_ptr<Block> takeBlockForCopies(uint64_t bytes);

  // Frees buffers and blocks idle for kStagedIdleMs whose last use has
  // completed (any thread; cheap when there is nothing to free).
  void trim();

  // Every pool made so far: trim(), and the pinned bytes they hold (for
  // counters). Make no pool.
  static void trimAll();
  static uint64_t pinnedBytesAll();

 private:
  explicit StagingPool(int device) : device_(device) {}
  // Moves retired host buffers and blocks whose event has completed to the
  // free lists (mu_ held).
  void reapRetiredLocked();

  using Clock = std::chrono::steady_clock;
  const int device_;
  mutable std::mutex mu_;
  // Free buffers and blocks by capacity, with when they were last given
  // back.
  std::multimap<uint64_t, std::pair<HostBuffer, Clock::time_point>> freeHost_;
  std::vector<std::pair<HostBuffer, PooledEvent>> retiredHost_;
  std::multimap<uint64_t, std::pair<std::shared_ptr<Block>, Clock::time_point>>
      freeBlocks_;
  std::vector<std::shared_ptr<Block>> retiredBlocks_;
  std::mutex eventsMu_; // freeEvents_
  std::vector<CUevent> freeEvents_;
  uint64_t pinnedBytes_ = 0; // allocated
  uint64_t pinnedInUse_ = 0; // taken and not yet given back
  CUstream copyStream_ = nullptr;
  Clock::time_point lastTrim_ = Clock::now();
};

// A received segment's device memory: a block of `pool`, filled by copies on
// `copyStream` (cuda_staged's from pinned memory, on the pool's stream;
// cuda_ipc's out of a legacy block, on its connection's, which the region
// keeps alive), ready at `ready`. When it dies, the block goes back once the
// work queued by then on every stream it was used on has finished (the
// block's lastUse event, which the next copy into it waits for).
class PooledRegion final : public frame::DeviceRegion {
 public:
  PooledRegion(
      StagingPool& pool,
      std::shared_ptr<StagingPool::Block> block,
      PooledEvent ready,
      std::shared_ptr<CUstream_st> copyStream)
      : pool_(pool),
        block_(std::move(block)),
        ready_(std::move(ready)),
        copyStream_(std::move(copyStream)) {}
  ~PooledRegion() override;

  int device() const override {
    return pool_.device();
  }
  void waitOn(uintptr_t stream) override;
  void recordUse(uintptr_t stream) override;

 private:
  StagingPool& pool_;
  std::shared_ptr<StagingPool::Block> block_;
  PooledEvent ready_;
  const std::shared_ptr<CUstream_st> copyStream_;
  std::mutex mu_;
  std::vector<CUstream> streams_; // it was used on
};

// What to allocate for a request of `bytes`: powers of two up to 64 MiB
// (so a pooled buffer serves sizes within 2x), 2 MiB multiples above.
uint64_t stagingCapacity(uint64_t bytes);

} // namespace torch_rpc_ext::channel::cuda
