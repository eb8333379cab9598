// SPDX-License-Identifier: BSD-3-Clause
// The landing pool (landing_pool.h).
#include "csrc/agent/landing_pool.h"

#include <exception>
#include <unordered_map>

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/StreamGuard.h>
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

LandingPools::LandingPools(std::map<int, PoolId> pools)
    : pools_(std::move(pools)) {}

namespace {

// One routing window per pool at a time, process-wide (torch refuses a
// second begin of a pool, after raising its use count): pools are the
// process's, whatever agent or hook opens the window.
std::mutex& windowOf(PoolId id) {
  static std::mutex mu;
  static std::map<PoolId, std::unique_ptr<std::mutex>> windows;
  std::lock_guard<std::mutex> lock(mu);
  auto& w = windows[id];
  if (!w) {
    w = std::make_unique<std::mutex>();
  }
  return *w;
}

} // namespace

c10::DataPtr LandingPools::allocate(
    c10::DeviceIndex device,
    const c10::Stream& stream,
    size_t n) {
  const PoolId id = pools_.at(device);
  PoolRouting* routing = poolRouting();
  TORCH_CHECK(
      routing != nullptr,
      "torch_rpc_ext: the landing pool of cuda:",
      int(device),
      " has no routing (this torch's CUDA caching allocator was not found)");
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  auto* native = static_cast<CUstream>(impl.getStreamNativeHandle(stream));
  c10::Allocator* allocator = c10::GetAllocator(c10::kCUDA);
  // torch allocates for the current stream: the one the filter takes.
  c10::StreamGuard current(stream);
  auto routed = [&] {
    std::lock_guard<std::mutex> lock(windowOf(id));
    routing->begin(device, id, [native](CUstream s) { return s == native; });
    struct End {
      PoolRouting* routing;
      c10::DeviceIndex device;
      PoolId id;
      ~End() {
        try {
          routing->end(device, id);
        } catch (const std::exception& e) {
          logWarning(
              std::string(
                  "torch_rpc_ext: closing a landing pool's routing "
                  "failed: ") +
              e.what());
        }
      }
    } end{routing, device, id};
    return allocator->allocate(n);
  };
  c10::DataPtr p;
  try {
    p = routed();
  } catch (const c10::OutOfMemoryError&) {
    // A new segment of the pool did not fit. torch frees its default
    // pool's cache and retries only outside a window (and, before 2.13,
    // not while any is open): do that here, once.
    auto* cache = dynamic_cast<c10::DeviceAllocator*>(allocator);
    if (cache == nullptr) {
      throw;
    }
    cache->emptyCache();
    p = routed();
  }
  allocations_.fetch_add(1, std::memory_order_relaxed);
  return p;
}

} // namespace torch_rpc_ext

using torch_rpc_ext::segments;

extern "C" void* torch_rpc_ext_landing_alloc(
    size_t size,
    int device,
    CUstream) noexcept {
  // Called by torch's caching allocator under its lock: throws nothing;
  // nullptr is torch's out of memory.
  auto& s = segments();
  CUdeviceptr p = 0;
  try {
    torch_rpc_ext::channel::cuda::CurrentDevice current(device);
    if (torch_rpc_ext::libcuda().cuMemAlloc(&p, size) != CUDA_SUCCESS) {
      p = 0;
    }
    std::lock_guard<std::mutex> lock(s.mu);
    if (p == 0) {
      ++s.counts.failed;
      return nullptr;
    }
    s.live.emplace(static_cast<uintptr_t>(p), std::make_pair(size, device));
    ++s.counts.made;
    ++s.counts.live;
    s.counts.liveBytes += size;
    return reinterpret_cast<void*>(p);
  } catch (...) {
    if (p != 0) {
      torch_rpc_ext::libcuda().cuMemFree(p); // not recorded: not handed out
    }
    return nullptr;
  }
}

extern "C" void torch_rpc_ext_landing_free(
    void* ptr,
    size_t,
    int device,
    CUstream) noexcept {
  auto& s = segments();
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  try {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.live.find(address);
    if (it == s.live.end()) {
      return; // not ours (torch checks its own pointers before this)
    }
    ++s.counts.freed;
    --s.counts.live;
    s.counts.liveBytes -= it->second.first;
    s.live.erase(it);
  } catch (...) {
    return;
  }
  try {
    torch_rpc_ext::channel::cuda::CurrentDevice current(device);
    const CUresult rc = torch_rpc_ext::libcuda().cuMemFree(address);
    if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_DEINITIALIZED) {
      torch_rpc_ext::logWarning(
          "torch_rpc_ext: freeing a landing pool segment failed: " +
          torch_rpc_ext::cudaErrorText("cuMemFree", rc));
    }
  } catch (...) {
    torch_rpc_ext::logWarning(
        "torch_rpc_ext: freeing a landing pool segment failed");
  }
}
