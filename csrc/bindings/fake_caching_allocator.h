// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The fake CUDA torch's allocator (torch_rpc_ext._testing.cuda): a CUDA
// allocator with the caching allocator's stream rules
// (c10/cuda/CUDACachingAllocator), so that the agent's received tensors meet
// them here as on a GPU: memory is allocated for the current stream and
// reused on it at once once freed; a free after record_stream (torch's
// recordDataPtrOnStream, which a future's wait() calls on the streams it
// makes wait) makes the block wait, reusable only once every recorded
// stream has passed the free (an event per stream, queried; taken from a
// pool of events per device and given back to it once passed, as torch's
// EventPool does, so that a steady state creates none); memory it did not
// allocate is skipped silently, as torch's is.
//
// And torch's memory pools as the landing pool uses them (landing_pool.h):
// a pool made with a segment allocator (torch.cuda.MemPool with a
// CUDAPluggableAllocator), allocations routed to it while a routing window
// whose filter takes their stream is open (beginAllocateToPool; one window
// per pool at a time), its freed blocks reused only by allocations routed
// to it, its segments left alone by emptyCache() while the pool lives and
// given back through its allocator once it is gone. Blocks are their own
// segments here: a pool's freed block is reused whole for any request it
// holds, the smallest first (torch splits larger ones). A test hook.

#include <atomic>
#include <map>
#include <mutex>
#include <vector>

#include <c10/core/CachingDeviceAllocator.h>

#include "csrc/agent/landing_pool.h"

namespace torch_rpc_ext::bindings {

class FakeCachingAllocator final : public c10::DeviceAllocator {
 public:
  struct Stats {
    uint64_t allocated = 0; // blocks made
    uint64_t reused = 0; // allocations served from a freed block
    uint64_t deferred = 0; // frees that waited for recorded streams
    uint64_t skippedRecords = 0; // record_stream on memory not ours
    uint64_t emptied = 0; // cached blocks given back by emptyCache()
    uint64_t poolAllocated = 0; // of `allocated`, from a pool's allocator
    uint64_t poolReused = 0; // of `reused`, a pool's
    uint64_t poolReleased = 0; // pool segments given back through it
    uint64_t windows = 0; // routings begun (beginAllocateToPool)
  };
  using SegmentAlloc = void* (*)(size_t, int, CUstream);
  using SegmentFree = void (*)(void*, size_t, int, CUstream);

  static FakeCachingAllocator& instance();

  // As torch's: no per-device tables, so no allocation, before torch's
  // lazy CUDA init, which a CPU torch stands in for with torch_cuda_init()
  // (the tests' torch.cuda.init). A worker that never ran it fails as
  // torch's allocator fails on a GPU.
  bool initialized() override {
    return initialized_.load();
  }
  void init() {
    initialized_.store(true);
  }
  // Gives back to the driver the cached blocks no stream still uses: of
  // the default pool, and of pools that are gone.
  void emptyCache(c10::MempoolId_t) override;
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(
      c10::DeviceIndex) override {
    return {};
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex) override {}
  c10::DataPtr allocate(size_t n) override;
  void copy_data(void* dst, const void* src, size_t n) const override;
  // torch's recordStream: a block of ours is used on `stream` too.
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override;
  Stats stats();

  // torch.cuda.MemPool(allocator) on `device`: a pool and its id.
  PoolId createPool(c10::DeviceIndex device, SegmentAlloc a, SegmentFree f);
  // The MemPool object's end: its use dropped, its free segments given
  // back (those still in use go back when freed).
  void destroyPool(PoolId id);
  // beginAllocateToPool / endAllocateToPool + releasePool.
  void beginAllocateToPool(
      c10::DeviceIndex device,
      PoolId id,
      PoolRouting::Filter filter);
  void endAllocateToPool(c10::DeviceIndex device, PoolId id);
  // The routing above, as the agent reaches it.
  PoolRouting& routing();

 private:
  struct Pool;
  struct Block {
    CUdeviceptr address;
    size_t size;
    c10::DeviceIndex device;
    c10::Stream stream; // allocated for
    std::vector<c10::Stream> uses; // recorded on, besides `stream`
    std::vector<CUevent> pending; // recorded at the free on each of `uses`
    Pool* pool = nullptr; // a pool's (its allocator made it), or the default
  };
  struct Pool {
    PoolId id;
    c10::DeviceIndex device;
    SegmentAlloc alloc;
    SegmentFree free;
    int uses = 1; // the MemPool's own, and each open window's
    bool routed = false;
    std::vector<Block*> cached; // freed, for reuse by routed allocations
    size_t live = 0; // blocks handed out
  };
  struct Route {
    c10::DeviceIndex device;
    Pool* pool;
    PoolRouting::Filter filter;
  };

  static void release(void* ctx);
  void free(Block* b);
  // Whether every stream recorded on `b` has passed its free (mu_ held).
  bool passed(Block& b);
  // A block from `cached` for `size` on `stream` (of that size, or with
  // `bestFit` the smallest that holds it), or nullptr (mu_ held).
  Block* reuse(
      std::vector<Block*>& cached,
      c10::DeviceIndex device,
      const c10::Stream& stream,
      size_t size,
      bool bestFit);
  // Gives a pool's block back through its allocator (mu_ held).
  void releaseToPool(Pool& pool, Block* b);
  // Frees what a pool with no use left caches, and forgets it once it
  // holds nothing (mu_ held).
  void sweep(Pool& pool);
  static Block* newBlock(
      CUdeviceptr address,
      size_t size,
      const c10::Stream& stream);
  c10::DataPtr own(Block* b);

  std::mutex mu_;
  std::map<c10::DeviceIndex, std::vector<CUevent>> events_; // passed, idle
  std::vector<Block*> free_;
  std::map<PoolId, Pool> pools_;
  std::vector<Route> routes_; // open windows, newest last
  unsigned long long nextPool_ = 1;
  Stats stats_;
  std::atomic<bool> initialized_{false};
};

} // namespace torch_rpc_ext::bindings
