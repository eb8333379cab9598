// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/buffer_pool.h"

#include <sys/mman.h>

#include <cstdint>
#include <new>
#include <vector>

namespace torch_rpc_ext {

namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kPage = 4096;

size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

// A mapping of `capacity` bytes (a multiple of kPage). From kHugePage up it
// is 2 MiB-aligned and advised for transparent huge pages: the whole 2 MiB
// extents in it fault in a huge page at a time, a partial one at its end in
// small pages, so no byte beyond the request is zeroed. Below kHugePage, an
// ordinary mapping: a huge page would zero twice the bytes of a 1 MiB
// block (at 64 workers all-to-all with 1 MiB tensors that zeroing was half
// of all CPU time).
void* mapBlock(size_t capacity) {
  if (capacity < kHugePage) {
    void* p = ::mmap(
        nullptr,
        capacity,
        PROT_READ | PROT_WRITE,
        MAP_PRIVATE | MAP_ANONYMOUS,
        -1,
        0);
    if (p == MAP_FAILED) {
      throw std::bad_alloc();
    }
    return p;
  }
  size_t span = capacity + kHugePage;
  void* raw = ::mmap(
      nullptr,
      span,
      PROT_READ | PROT_WRITE,
      MAP_PRIVATE | MAP_ANONYMOUS,
      -1,
      0);
  if (raw == MAP_FAILED) {
    throw std::bad_alloc();
  }
  auto start = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = roundUp(start, kHugePage);
  if (aligned > start) {
    ::munmap(raw, aligned - start);
  }
  uintptr_t end = start + span;
  if (end > aligned + capacity) {
    ::munmap(
        reinterpret_cast<void*>(aligned + capacity), end - aligned - capacity);
  }
  void* p = reinterpret_cast<void*>(aligned);
  ::madvise(p, capacity, MADV_HUGEPAGE); // best effort: THP may be off
  return p;
}

} // namespace

BufferPool::BufferPool(
    size_t maxCachedBytes,
    std::chrono::milliseconds idleRelease)
    : maxCachedBytes_(maxCachedBytes), idleRelease_(idleRelease) {}

BufferPool::~BufferPool() {
  trim(/*all=*/true);
}

BufferPool::Block BufferPool::acquire(size_t size) {
  size_t want = roundUp(size == 0 ? 1 : size, kPage);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = cache_.lower_bound(want);
    if (it != cache_.end() && it->first <= 2 * want) {
      Block b{it->second.data, it->first};
      cachedBytes_ -= it->first;
      cache_.erase(it);
      ++live_;
      return b;
    }
  }
  Block b{mapBlock(want), want};
  std::lock_guard<std::mutex> lock(mutex_);
  ++live_;
  return b;
}

void BufferPool::release(Block block) {
  std::vector<std::pair<void*, size_t>> unmap;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --live_;
    auto now = std::chrono::steady_clock::now();
    // Make room by dropping the stalest blocks; a block bigger than the
    // whole budget is not kept at all.
    if (block.capacity <= maxCachedBytes_) {
      while (cachedBytes_ + block.capacity > maxCachedBytes_ &&
             !cache_.empty()) {
        auto oldest = cache_.begin();
        for (auto it = cache_.begin(); it != cache_.end(); ++it) {
          if (it->second.since < oldest->second.since) {
            oldest = it;
          }
        }
        unmap.emplace_back(oldest->second.data, oldest->first);
        cachedBytes_ -= oldest->first;
        cache_.erase(oldest);
      }
      cache_.emplace(block.capacity, Cached{block.data, now});
      cachedBytes_ += block.capacity;
    } else {
      unmap.emplace_back(block.data, block.capacity);
    }
  }
  for (auto& [p, n] : unmap) {
    ::munmap(p, n);
  }
}

void BufferPool::trim(bool all) {
  std::vector<std::pair<void*, size_t>> unmap;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto now = std::chrono::steady_clock::now();
    for (auto it = cache_.begin(); it != cache_.end();) {
      if (all || now - it->second.since >= idleRelease_) {
        unmap.emplace_back(it->second.data, it->first);
        cachedBytes_ -= it->first;
        it = cache_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [p, n] : unmap) {
    ::munmap(p, n);
  }
}

size_t BufferPool::cachedBytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cachedBytes_;
}

size_t BufferPool::liveBlocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_;
}

} // namespace torch_rpc_ext
