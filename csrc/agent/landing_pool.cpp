// SPDX-License-Identifier: BSD-3-Clause
// The landing pool (landing_pool.h).
#include "csrc/agent/landing_pool.h"

#include <exception>
#include <unordered_map>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "csrc/channel/cuda/device.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

namespace {

// The segments our allocator made, by address (torch hands back exactly
// the pointers it was given).
struct Segments {
  std::mutex mu;
  std::unordered_map<uintptr_t, std::pair<size_t, int>> live;
  LandingSegmentCounts counts;
};

Segments& segments() {
  static auto* s = new Segments(); // outlives torch's pools at exit
  return *s;
}

std::atomic<PoolRouting*> testRouting{nullptr};

} // namespace

void setPoolRoutingForTests(PoolRouting* routing) {
  testRouting.store(routing);
}

PoolRouting* poolRouting() {
  if (PoolRouting* torch = torchPoolRouting()) {
    return torch;
  }
  return testRouting.load();
}

LandingSegmentCounts landingSegmentCounts() {
  auto& s = segments();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.counts;
}

LandingPools::LandingPools(std::map<int, PoolId> pools) {
  for (const auto& [device, id] : pools) {
    auto p = std::make_unique<Pool>();
    p->id = id;
    pools_.emplace(device, std::move(p));
  }
}

c10::DataPtr LandingPools::allocate(
    c10::DeviceIndex device,
    const c10::Stream& stream,
    size_t n) {
  Pool& pool = *pools_.at(device);
  PoolRouting* routing = poolRouting();
  TORCH_CHECK(
      routing != nullptr,
      "torch_rpc_ext: the landing pool of cuda:",
      int(device),
      " has no routing (this torch's CUDA caching allocator was not found)");
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  auto* native = static_cast<CUstream>(impl.getStreamNativeHandle(stream));
  c10::Allocator* allocator = c10::GetAllocator(c10::kCUDA);
  // One window at a time per pool (torch refuses a second begin of one
  // pool), opened only around the allocation.
  std::lock_guard<std::mutex> lock(pool.mu);
  routing->begin(device, pool.id, [native](CUstream s) { return s == native; });
  struct End {
    PoolRouting* routing;
    c10::DeviceIndex device;
    PoolId id;
    ~End() {
      routing->end(device, id);
    }
  } end{routing, device, pool.id};
  c10::DataPtr p = allocator->allocate(n);
  allocations_.fetch_add(1, std::memory_order_relaxed);
  return p;
}

} // namespace torch_rpc_ext

using torch_rpc_ext::segments;

extern "C" void*
torch_rpc_ext_landing_alloc(size_t size, int device, CUstream) {
  // Called by torch's caching allocator under its lock: throws nothing.
  auto& s = segments();
  try {
    torch_rpc_ext::channel::cuda::CurrentDevice current(device);
    CUdeviceptr p = 0;
    const CUresult rc = torch_rpc_ext::libcuda().cuMemAlloc(&p, size);
    std::lock_guard<std::mutex> lock(s.mu);
    if (rc != CUDA_SUCCESS) {
      ++s.counts.failed;
      return nullptr;
    }
    s.live.emplace(static_cast<uintptr_t>(p), std::make_pair(size, device));
    ++s.counts.made;
    ++s.counts.live;
    s.counts.liveBytes += size;
    return reinterpret_cast<void*>(p);
  } catch (const std::exception&) {
    std::lock_guard<std::mutex> lock(s.mu);
    ++s.counts.failed;
    return nullptr;
  }
}

extern "C" void
torch_rpc_ext_landing_free(void* ptr, size_t, int device, CUstream) {
  auto& s = segments();
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.live.find(address);
    if (it == s.live.end()) {
      return; // not ours (torch checks its own pointers before this)
    }
    ++s.counts.freed;
    --s.counts.live;
    s.counts.liveBytes -= it->second.first;
    s.live.erase(it);
  }
  try {
    torch_rpc_ext::channel::cuda::CurrentDevice current(device);
    const CUresult rc = torch_rpc_ext::libcuda().cuMemFree(address);
    if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_DEINITIALIZED) {
      torch_rpc_ext::logWarning(
          "torch_rpc_ext: freeing a landing pool segment failed: " +
          torch_rpc_ext::cudaErrorText("cuMemFree", rc));
    }
  } catch (const std::exception& e) {
    torch_rpc_ext::logWarning(
        std::string("torch_rpc_ext: freeing a landing pool segment failed: ") +
        e.what());
  }
}
