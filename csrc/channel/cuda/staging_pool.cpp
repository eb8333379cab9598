// SPDX-License-Identifier: BSD-3-Clause
// cuda_staged's pinned buffers, device blocks and events, and the regions
// received tensors view in them (staging_pool.h).
#include "csrc/channel/cuda/staging_pool.h"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/device_memory.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

constexpr uint64_t kMiB = uint64_t(1) << 20;
constexpr int kMaxPoolDevices = 64;

struct Pools {
  std::mutex mu;
  std::array<StagingPool*, kMaxPoolDevices> byDevice{};
};

Pools& pools() {
  static Pools* p = new Pools(); // leaked with the process
  return *p;
}

} // namespace

uint64_t stagingCapacity(uint64_t bytes) {
  if (bytes <= 64 * kMiB) {
    uint64_t c = 64 * 1024;
    while (c < bytes) {
      c <<= 1;
    }
    return c;
  }
  return (bytes + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB);
}

StagingPool& StagingPool::of(int device) {
  primaryContext(device); // throws naming a device that does not exist
  Pools& p = pools();
  std::lock_guard<std::mutex> lock(p.mu);
  if (device >= kMaxPoolDevices) {
    throw std::out_of_range("cuda_staged serves devices 0..63");
  }
  if (p.byDevice[device] == nullptr) {
    p.byDevice[device] = new StagingPool(device);
  }
  return *p.byDevice[device];
}

StagingPool::HostBuffer StagingPool::takeHost(
    uint64_t bytes,
    std::string* why) {
  uint64_t capacity = stagingCapacity(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    reapRetiredLocked();
    // The smallest free buffer that fits, if it is not over twice the need.
    auto it = freeHost_.lower_bound(bytes);
    if (it != freeHost_.end() && it->first <= 2 * capacity &&
        pinnedInUse_ + it->first <= kMaxPinnedBytes) {
      HostBuffer b = it->second.first;
      freeHost_.erase(it);
      pinnedInUse_ += b.capacity;
      return b;
    }
    if (pinnedInUse_ + capacity > kMaxPinnedBytes) {
      *why = "cuda_staged has " + std::to_string(pinnedInUse_ >> 20) +
          " MiB of pinned memory of cuda:" + std::to_string(device_) +
          " in use, and " + std::to_string(capacity >> 20) +
          " MiB more would pass its limit of " +
          std::to_string(kMaxPinnedBytes >> 20) + " MiB";
      return {};
    }
    pinnedInUse_ += capacity;
  }
  HostBuffer b;
  b.capacity = capacity;
  try {
    CurrentDevice current(device_);
    void* p = nullptr;
    TORCH_RPC_EXT_CUDA_CHECK(cuMemHostAlloc, &p, capacity, 0);
    b.data = static_cast<char*>(p);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    pinnedInUse_ -= capacity;
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  pinnedBytes_ += capacity;
  return b;
}

void StagingPool::giveHost(HostBuffer buffer) {
  if (buffer.data == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  pinnedInUse_ -= buffer.capacity;
  freeHost_.emplace(buffer.capacity, std::make_pair(buffer, Clock::now()));
}

void StagingPool::retireHost(HostBuffer buffer, PooledEvent after) {
  if (buffer.data == nullptr) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  retiredHost_.emplace_back(buffer, std::move(after));
}

void StagingPool::reapRetiredLocked() {
  RelaxedCapture relaxed; // (device.h)
  for (size_t i = 0; i < retiredHost_.size();) {
    // A query, never a wait. An error (a broken context) keeps it: memory
    // the device may still write must not be reused.
    if (libcuda().cuEventQuery(retiredHost_[i].second.get()) != CUDA_SUCCESS) {
      ++i;
      continue;
    }
    HostBuffer b = retiredHost_[i].first;
    pinnedInUse_ -= b.capacity;
    freeHost_.emplace(b.capacity, std::make_pair(b, Clock::now()));
    retiredHost_[i] = std::move(retiredHost_.back());
    retiredHost_.pop_back();
  }
  for (size_t i = 0; i < retiredBlocks_.size();) {
    if (libcuda().cuEventQuery(retiredBlocks_[i]->lastUse) != CUDA_SUCCESS) {
      ++i;
      continue;
    }
    const uint64_t c = retiredBlocks_[i]->capacity;
    freeBlocks_.emplace(
        c, std::make_pair(std::move(retiredBlocks_[i]), Clock::now()));
    retiredBlocks_[i] = std::move(retiredBlocks_.back());
    retiredBlocks_.pop_back();
  }
}

std::shared_ptr<StagingPool::Block> StagingPool::takeBlock(uint64_t bytes) {
  uint64_t capacity = stagingCapacity(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!retiredBlocks_.empty()) {
      reapRetiredLocked();
    }
    auto it = freeBlocks_.lower_bound(bytes);
    if (it != freeBlocks_.end() && it->first <= 2 * capacity) {
      auto b = std::move(it->second.first);
      freeBlocks_.erase(it);
      return b;
    }
  }
  CurrentDevice current(device_);
  auto b = std::make_shared<Block>();
  // Out of memory once: torch's cached blocks are freed, and again.
  allocateWithRetry(device_, [&] {
    TORCH_RPC_EXT_CUDA_CHECK(cuMemAlloc, &b->address, capacity);
  });
  b->capacity = capacity;
  CUresult rc = libcuda().cuEventCreate(&b->lastUse, CU_EVENT_DISABLE_TIMING);
  if (rc != CUDA_SUCCESS) {
    libcuda().cuMemFree(b->address);
    checkCuda("cuEventCreate", rc);
  }
  addStagingBytes(static_cast<int64_t>(capacity));
  return b;
}

void StagingPool::giveBlock(std::shared_ptr<Block> block) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t c = block->capacity;
  freeBlocks_.emplace(c, std::make_pair(std::move(block), Clock::now()));
}

void StagingPool::retireBlock(std::shared_ptr<Block> block) {
  std::lock_guard<std::mutex> lock(mu_);
  retiredBlocks_.push_back(std::move(block));
}

PooledEvent StagingPool::takeEvent() {
  CUevent e = nullptr;
  {
    std::lock_guard<std::mutex> lock(eventsMu_);
    if (!freeEvents_.empty()) {
      e = freeEvents_.back();
      freeEvents_.pop_back();
    }
  }
  if (e == nullptr) {
    CurrentDevice current(device_);
    TORCH_RPC_EXT_CUDA_CHECK(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
  }
  // The pool outlives every event (it is never destroyed).
  // (Dropped under mu_ too, by reapRetiredLocked: hence a lock of its own.)
  return PooledEvent(e, [this](CUevent done) {
    std::lock_guard<std::mutex> lock(eventsMu_);
    freeEvents_.push_back(done);
  });
}

CUstream StagingPool::copyStream() {
  std::lock_guard<std::mutex> lock(mu_);
  if (copyStream_ == nullptr) {
    CurrentDevice current(device_);
    TORCH_RPC_EXT_CUDA_CHECK(
        cuStreamCreate, &copyStream_, CU_STREAM_NON_BLOCKING);
  }
  return copyStream_;
}

std::shared_ptr<StagingPool::Block> StagingPool::takeBlockForCopies(
    uint64_t bytes) {
  auto block = takeBlock(bytes);
  if (block->used) {
    try {
      CurrentDevice current(device_);
      TORCH_RPC_EXT_CUDA_CHECK(
          cuStreamWaitEvent, copyStream(), block->lastUse, 0);
    } catch (...) {
      giveBlock(std::move(block)); // its lastUse is recorded still
      throw;
    }
  }
  return block;
}

void StagingPool::trim() {
  RelaxedCapture relaxed; // its queries and frees (device.h)
  std::vector<HostBuffer> hosts;
  std::vector<std::shared_ptr<Block>> blocks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto now = Clock::now();
    if (now - lastTrim_ < std::chrono::milliseconds(kStagedIdleMs / 5)) {
      return;
    }
    lastTrim_ = now;
    reapRetiredLocked();
    auto idle = [&](Clock::time_point t) {
      return now - t > std::chrono::milliseconds(kStagedIdleMs);
    };
    for (auto it = freeHost_.begin(); it != freeHost_.end();) {
      if (idle(it->second.second)) {
        hosts.push_back(it->second.first);
        pinnedBytes_ -= it->second.first.capacity;
        it = freeHost_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = freeBlocks_.begin(); it != freeBlocks_.end();) {
      const auto& b = it->second.first;
      if (idle(it->second.second) &&
          (!b->used || libcuda().cuEventQuery(b->lastUse) == CUDA_SUCCESS)) {
        blocks.push_back(b);
        it = freeBlocks_.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (hosts.empty() && blocks.empty()) {
    return;
  }
  CurrentDevice current(device_);
  for (auto& h : hosts) {
    libcuda().cuMemFreeHost(h.data);
  }
  for (auto& b : blocks) {
    libcuda().cuEventDestroy(b->lastUse);
    libcuda().cuMemFree(b->address);
    addStagingBytes(-static_cast<int64_t>(b->capacity));
  }
}

namespace {

std::vector<StagingPool*> madePools() {
  Pools& p = pools();
  std::lock_guard<std::mutex> lock(p.mu);
  std::vector<StagingPool*> made;
  for (auto* pool : p.byDevice) {
    if (pool != nullptr) {
      made.push_back(pool);
    }
  }
  return made;
}

} // namespace

void StagingPool::trimAll() {
  for (auto* pool : madePools()) {
    pool->trim();
  }
}

uint64_t StagingPool::pinnedBytesAll() {
  uint64_t n = 0;
  for (auto* pool : madePools()) {
    std::lock_guard<std::mutex> lock(pool->mu_);
    n += pool->pinnedBytes_;
  }
  return n;
}

PooledRegion::~PooledRegion() {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    CurrentDevice current(pool_.device());
    // Unused: the copy onto the device was its last use.
    CUstream last = streams_.empty() ? copyStream_.get() : streams_.back();
    for (CUstream other : streams_) {
      if (other == last) {
        continue;
      }
      auto joined = pool_.takeEvent();
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, joined.get(), other);
      TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, last, joined.get(), 0);
    }
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block_->lastUse, last);
    block_->used = true;
    // What was to land here has not: its copy in may wait for ever (on a
    // dead peer's `ready`), and a next copy into the block would wait
    // behind it.
    RelaxedCapture relaxed; // the query (device.h)
    if (libcuda().cuEventQuery(ready_.get()) != CUDA_SUCCESS) {
      pool_.retireBlock(std::move(block_));
      return;
    }
  } catch (const std::exception& e) {
    // Not given back: the next copy into it must not race this use.
    logWarning(
        std::string(
            "torch_rpc_ext: keeping a pooled CUDA block that could not be "
            "released: ") +
        e.what());
    return;
  }
  pool_.giveBlock(std::move(block_));
}

void PooledRegion::recordUse(uintptr_t stream) {
  const auto s = reinterpret_cast<CUstream>(stream);
  std::lock_guard<std::mutex> lock(mu_);
  if (std::find(streams_.begin(), streams_.end(), s) == streams_.end()) {
    streams_.push_back(s);
  }
}

void PooledRegion::waitOn(uintptr_t stream) {
  const auto s = reinterpret_cast<CUstream>(stream);
  std::lock_guard<std::mutex> lock(mu_);
  // `ready` has one record: a stream that waited on it once is ordered
  // after it for good (the segments of one block share a region).
  if (std::find(streams_.begin(), streams_.end(), s) != streams_.end()) {
    return;
  }
  CurrentDevice current(pool_.device());
  TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, s, ready_.get(), 0);
  streams_.push_back(s);
}

} // namespace torch_rpc_ext::channel::cuda
