// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

namespace torch_rpc_ext {

// Large receive buffers, recycled.
//
// A fresh 400 MB allocation costs ~100k page faults on first touch (upstream
// TensorPipe's 400 MB round trip is dominated by them). Blocks of 2 MiB and
// more here are 2 MiB-aligned mmaps with MADV_HUGEPAGE, so first touch costs
// 512x fewer faults (smaller ones are plain mappings: a huge page would
// zero more than they hold), and a released block is kept (already faulted)
// for the next message of a similar size. The cache is bounded by
// `maxCachedBytes` and blocks idle for `idleRelease` go back to the kernel on
// the next trim(), so memory returns to baseline once traffic stops.
//
// Thread-safe. Blocks may be released after the pool's owner is gone: hold
// the pool by shared_ptr in whatever frees them.
class BufferPool {
 public:
  // Below this size, the ordinary allocator is as good.
  static constexpr size_t kMinPooledBytes = size_t(1) << 20;

  BufferPool(size_t maxCachedBytes, std::chrono::milliseconds idleRelease);
  ~BufferPool();

  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  struct Block {
    void* data = nullptr;
    size_t capacity = 0;
  };

  // A block of at least `size` bytes: a cached one no more than twice as
  // large if there is one, else a new mapping. Throws std::bad_alloc.
  Block acquire(size_t size);
  void release(Block block);
  // Unmap cached blocks idle for longer than idleRelease (all if `all`).
  void trim(bool all = false);

  size_t cachedBytes() const;
  // Blocks handed out and not yet released.
  size_t liveBlocks() const;

 private:
  struct Cached {
    void* data;
    std::chrono::steady_clock::time_point since;
  };

  const size_t maxCachedBytes_;
  const std::chrono::milliseconds idleRelease_;
  mutable std::mutex mutex_;
  std::multimap<size_t, Cached> cache_; // capacity -> block
  size_t cachedBytes_ = 0;
  size_t live_ = 0;
};

} // namespace torch_rpc_ext
