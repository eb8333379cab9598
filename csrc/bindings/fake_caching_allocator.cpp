// SPDX-License-Identifier: BSD-3-Clause
// The fake CUDA torch's allocator (fake_caching_allocator.h).
#include "csrc/bindings/fake_caching_allocator.h"

#include <algorithm>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "csrc/channel/registry.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::bindings {

namespace {

c10::impl::DeviceGuardImplInterface* guard() {
  return const_cast<c10::impl::DeviceGuardImplInterface*>(
      c10::impl::getDeviceGuardImpl(c10::kCUDA));
}

CUstream native(const c10::Stream& s) {
  return static_cast<CUstream>(guard()->getStreamNativeHandle(s));
}

class FakePoolRouting final : public PoolRouting {
 public:
  explicit FakePoolRouting(FakeCachingAllocator& a) : a_(a) {}
  void begin(c10::DeviceIndex device, PoolId id, Filter filter) override {
    a_.beginAllocateToPool(device, id, std::move(filter));
  }
  void end(c10::DeviceIndex device, PoolId id) override {
    a_.endAllocateToPool(device, id);
  }

 private:
  FakeCachingAllocator& a_;
};

} // namespace

FakeCachingAllocator& FakeCachingAllocator::instance() {
  static auto* a = new FakeCachingAllocator();
  return *a;
}

PoolRouting& FakeCachingAllocator::routing() {
  static auto* r = new FakePoolRouting(*this);
  return *r;
}

void FakeCachingAllocator::emptyCache(c10::MempoolId_t) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end();) {
    Block* b = *it;
    if (!passed(*b)) {
      ++it;
      continue;
    }
    channel::CudaDeviceScope current(b->device);
    libcuda().cuMemFree(b->address);
    delete b;
    it = free_.erase(it);
    ++stats_.emptied;
  }
  for (auto it = pools_.begin(); it != pools_.end();) {
    auto next = std::next(it);
    sweep(it->second); // may erase it
    it = next;
  }
}

FakeCachingAllocator::Block* FakeCachingAllocator::reuse(
    std::vector<Block*>& cached,
    c10::DeviceIndex device,
    const c10::Stream& stream,
    size_t size,
    bool bestFit) {
  // The default pool: a block of that very size. A pool's: the smallest
  // that fits, whole (torch's would split it), so that a pool's segments
  // are reused for smaller requests as torch's are.
  auto pick = cached.end();
  for (auto it = cached.begin(); it != cached.end(); ++it) {
    Block* b = *it;
    const bool fits = bestFit ? b->size >= size : b->size == size;
    if (b->device == device && b->stream == stream && fits && passed(*b) &&
        (pick == cached.end() || b->size < (*pick)->size)) {
      pick = it;
      if (b->size == size) {
        break;
      }
    }
  }
  if (pick == cached.end()) {
    return nullptr;
  }
  Block* b = *pick;
  cached.erase(pick);
  b->uses.clear();
  return b;
}

c10::DataPtr FakeCachingAllocator::allocate(size_t n) {
  auto* g = guard();
  const c10::Device device = g->getDevice();
  TORCH_CHECK(
      initialized_.load(),
      "Allocator not initialized for device ",
      int(device.index()),
      ": did you call init?");
  const c10::Stream stream = g->getStream(device);
  const size_t size = std::max<size_t>(512, (n + 511) / 512 * 512);
  std::lock_guard<std::mutex> lock(mu_);
  // Routed to a pool? (newest window first, as torch's get_pool)
  for (auto r = routes_.rbegin(); r != routes_.rend(); ++r) {
    if (r->device != device.index() || !r->filter(native(stream))) {
      continue;
    }
    Pool& pool = *r->pool;
    Block* b = reuse(pool.cached, device.index(), stream, size, true);
    if (b != nullptr) {
      ++stats_.reused;
      ++stats_.poolReused;
    } else {
      void* p = pool.alloc(size, device.index(), native(stream));
      TORCH_CHECK_WITH(
          OutOfMemoryError,
          p != nullptr,
          "CUDA out of memory: the pool's allocator refused ",
          size,
          " bytes on cuda:",
          int(device.index()));
      b = newBlock(reinterpret_cast<CUdeviceptr>(p), size, stream);
      b->pool = &pool;
      ++stats_.allocated;
      ++stats_.poolAllocated;
    }
    ++pool.live;
    return own(b);
  }
  if (Block* b = reuse(free_, device.index(), stream, size, false)) {
    ++stats_.reused;
    return own(b);
  }
  channel::CudaDeviceScope current(device.index());
  CUdeviceptr address = 0;
  CUresult rc = libcuda().cuMemAlloc(&address, size);
  if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
    // As torch's: its own cache first (mu_ is held: inline).
    for (auto it = free_.begin(); it != free_.end();) {
      if (passed(**it)) {
        libcuda().cuMemFree((*it)->address);
        delete *it;
        it = free_.erase(it);
        ++stats_.emptied;
      } else {
        ++it;
      }
    }
    rc = libcuda().cuMemAlloc(&address, size);
  }
  checkCuda("cuMemAlloc", rc);
  ++stats_.allocated;
  return own(newBlock(address, size, stream));
}

FakeCachingAllocator::Block* FakeCachingAllocator::newBlock(
    CUdeviceptr address,
    size_t size,
    const c10::Stream& stream) {
  auto* b = new Block{address, size, stream.device_index(), stream, {}, {}};
  return b;
}

c10::DataPtr FakeCachingAllocator::own(Block* b) {
  return c10::DataPtr(
      reinterpret_cast<void*>(b->address),
      b,
      &release,
      c10::Device(c10::kCUDA, b->device));
}

void FakeCachingAllocator::copy_data(void* dst, const void* src, size_t n)
    const {
  TORCH_RPC_EXT_CUDA_CHECK(
      cuMemcpyAsync,
      reinterpret_cast<CUdeviceptr>(dst),
      reinterpret_cast<CUdeviceptr>(src),
      n,
      nullptr);
  TORCH_RPC_EXT_CUDA_CHECK(cuStreamSynchronize, nullptr);
}

void FakeCachingAllocator::recordStream(
    const c10::DataPtr& ptr,
    c10::Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ptr.get() == nullptr || ptr.get_deleter() != &release) {
    ++stats_.skippedRecords;
    return;
  }
  auto* b = static_cast<Block*>(ptr.get_context());
  if (stream != b->stream &&
      std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) {
    b->uses.push_back(stream);
  }
}

FakeCachingAllocator::Stats FakeCachingAllocator::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void FakeCachingAllocator::release(void* ctx) {
  instance().free(static_cast<Block*>(ctx));
}

void FakeCachingAllocator::free(Block* b) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!b->uses.empty()) {
    ++stats_.deferred;
    channel::CudaDeviceScope current(b->device);
    auto& idle = events_[b->device];
    for (const auto& use : b->uses) {
      CUevent e = nullptr;
      if (!idle.empty()) {
        e = idle.back();
        idle.pop_back();
      }
      if (e != nullptr ||
          libcuda().cuEventCreate(&e, CU_EVENT_DISABLE_TIMING) ==
              CUDA_SUCCESS) {
        libcuda().cuEventRecord(e, native(use));
        b->pending.push_back(e);
      }
    }
  }
  if (b->pool == nullptr) {
    free_.push_back(b);
    return;
  }
  Pool& pool = *b->pool;
  --pool.live;
  pool.cached.push_back(b);
  sweep(pool);
}

bool FakeCachingAllocator::passed(Block& b) {
  while (!b.pending.empty()) {
    if (libcuda().cuEventQuery(b.pending.back()) != CUDA_SUCCESS) {
      return false;
    }
    events_[b.device].push_back(b.pending.back()); // for the next free
    b.pending.pop_back();
  }
  return true;
}

void FakeCachingAllocator::releaseToPool(Pool& pool, Block* b) {
  pool.free(reinterpret_cast<void*>(b->address), b->size, b->device, nullptr);
  delete b;
  ++stats_.poolReleased;
}

void FakeCachingAllocator::sweep(Pool& pool) {
  if (pool.uses > 0) {
    return; // a live pool keeps its segments (torch's empty_cache too)
  }
  for (auto it = pool.cached.begin(); it != pool.cached.end();) {
    if (passed(**it)) {
      releaseToPool(pool, *it);
      it = pool.cached.erase(it);
    } else {
      ++it;
    }
  }
  if (pool.live == 0 && pool.cached.empty()) {
    const PoolId id = pool.id; // (the key lives in the node erased)
    pools_.erase(id);
  }
}

PoolId FakeCachingAllocator::createPool(
    c10::DeviceIndex device,
    SegmentAlloc a,
    SegmentFree f) {
  std::lock_guard<std::mutex> lock(mu_);
  const PoolId id{0, nextPool_++};
  Pool& pool = pools_[id];
  pool.id = id;
  pool.device = device;
  pool.alloc = a;
  pool.free = f;
  return id;
}

void FakeCachingAllocator::destroyPool(PoolId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pools_.find(id);
  TORCH_CHECK(it != pools_.end(), "no such pool");
  TORCH_CHECK(
      !it->second.routed,
      "a pool destroyed while allocations are routed to it");
  --it->second.uses;
  sweep(it->second);
}

void FakeCachingAllocator::beginAllocateToPool(
    c10::DeviceIndex device,
    PoolId id,
    PoolRouting::Filter filter) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pools_.find(id);
  TORCH_CHECK(
      it != pools_.end() && it->second.uses > 0,
      "beginAllocateToPool: no such pool");
  Pool& pool = it->second;
  TORCH_CHECK(pool.device == device, "beginAllocateToPool: another device");
  TORCH_CHECK(!pool.routed, "beginAllocateToPool: already recording to pool");
  pool.routed = true;
  ++pool.uses;
  ++stats_.windows;
  routes_.push_back({device, &pool, std::move(filter)});
}

void FakeCachingAllocator::endAllocateToPool(
    c10::DeviceIndex device,
    PoolId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) {
    return r.device == device && r.pool->id == id;
  });
  TORCH_CHECK(r != routes_.end(), "endAllocatePool: not currently recording");
  Pool& pool = *r->pool;
  routes_.erase(r);
  pool.routed = false;
  --pool.uses; // releasePool
  sweep(pool);
}

} // namespace torch_rpc_ext::bindings
