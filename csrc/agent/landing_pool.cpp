// SPDX-License-Identifier: BSD-3-Clause
// The landing pool (landing_pool.h).
#include "csrc/agent/landing_pool.h"

#include <atomic>
#include <exception>
#include <map>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "csrc/channel/grants.h"
#include "csrc/channel/registry.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

namespace {

// The segments our allocator made, by address (torch hands back exactly
// the pointers it was given).
struct PoolSegment {
  size_t size;
  int device;
  uint64_t key; // unique per allocation
  int shared = 0; // connections whose peer may have it open
  bool freed = false; // torch gave it back while shared: freed at the last
};
struct PoolSegments {
  std::mutex mu;
  std::map<uintptr_t, PoolSegment> live;
  uint64_t nextKey = 1;
  LandingSegmentCounts counts;
};

PoolSegments& poolSegments() {
  static auto* s = new PoolSegments(); // outlives torch's pools at exit
  return *s;
}

std::atomic<PoolRouting*> testPoolRouting{nullptr};

} // namespace

void setPoolRoutingForTests(PoolRouting* routing) {
  testPoolRouting.store(routing);
}

PoolRouting* poolRouting() {
  if (PoolRouting* torch = torchPoolRouting()) {
    return torch;
  }
  return testPoolRouting.load();
}

LandingSegmentCounts landingSegmentCounts() {
  auto& s = poolSegments();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.counts;
}

LandingPools::LandingPools(std::map<int, PoolId> pools)
    : pools_(std::move(pools)) {}

namespace {

// One routing window per pool at a time, process-wide (torch refuses a
// second begin of a pool, after raising its use count): pools are the
// process's, whatever agent or hook opens the window.
std::mutex& poolWindowOf(PoolId id) {
  static std::mutex mu;
  static std::map<PoolId, std::unique_ptr<std::mutex>> windows;
  std::lock_guard<std::mutex> lock(mu);
  auto& w = windows[id];
  if (!w) {
    w = std::make_unique<std::mutex>();
  }
  return *w;
}

std::atomic<uint64_t>& poolAllocations() {
  static std::atomic<uint64_t> n{0};
  return n;
}

} // namespace

uint64_t landingPoolAllocations() {
  return poolAllocations().load(std::memory_order_relaxed);
}

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
  std::lock_guard<std::mutex> lock(poolWindowOf(id));
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
                "torch_rpc_ext: closing a landing pool's routing failed: ") +
            e.what());
      }
    }
  } end{routing, device, id};
  c10::DataPtr p = allocator->allocate(n);
  poolAllocations().fetch_add(1, std::memory_order_relaxed);
  return p;
}

namespace {

// The segment holding [p, p + n), if ours.
bool poolSegmentOf(uintptr_t p, size_t n, uintptr_t* base, PoolSegment* out) {
  auto& s = poolSegments();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.live.upper_bound(p);
  if (it == s.live.begin()) {
    return false;
  }
  --it;
  if (it->second.freed || p + n > it->first + it->second.size) {
    return false;
  }
  *base = it->first;
  *out = it->second;
  return true;
}

void freePoolSegment(uintptr_t address, int device) {
  std::string error;
  if (!channel::cudaMemFree(device, address, &error)) {
    logWarning(
        "torch_rpc_ext: freeing a landing pool segment failed: " + error);
  }
}

// Landing memory granted to peers, from the landing pools, on a grant
// stream per device (from torch's high-priority pool, as the landing
// streams, not the arrival streams' low-priority one: a grant's free event
// then waits for no user work; a user's allocation routed into the pool
// with ours is never granted).
class PoolGrants final : public channel::GrantSource {
 public:
  explicit PoolGrants(std::map<int, PoolId> pools) : pools_(std::move(pools)) {}

  channel::GrantMemory allocate(int device, uint64_t bytes) override {
    const auto d = static_cast<c10::DeviceIndex>(device);
    const c10::Stream stream = streamOf(d);
    channel::GrantMemory g;
    auto memory = std::make_unique<TorchLanded>();
    memory->memory = pools_.allocate(d, stream, bytes);
    const auto address = reinterpret_cast<uintptr_t>(memory->memory.get());
    g.memory = std::move(memory);
    c10::impl::VirtualGuardImpl impl(c10::kCUDA);
    g.stream = static_cast<CUstream>(impl.getStreamNativeHandle(stream));
    PoolSegment segment{};
    uintptr_t base = 0;
    TORCH_CHECK(
        poolSegmentOf(address, bytes, &base, &segment),
        "torch_rpc_ext: a grant's memory is not in a landing pool segment");
    g.segmentBase = base;
    g.segmentSize = segment.size;
    g.segmentKey = segment.key;
    return g;
  }
  void segmentShared(uint64_t key) override {
    auto& s = poolSegments();
    std::lock_guard<std::mutex> lock(s.mu);
    for (auto& [address, segment] : s.live) {
      if (segment.key == key) {
        ++segment.shared;
      }
    }
  }
  void segmentUnshared(uint64_t key) override {
    auto& s = poolSegments();
    uintptr_t address = 0;
    int device = 0;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      for (auto it = s.live.begin(); it != s.live.end(); ++it) {
        if (it->second.key != key) {
          continue;
        }
        if (--it->second.shared > 0 || !it->second.freed) {
          return;
        }
        address = it->first;
        device = it->second.device;
        ++s.counts.freed;
        --s.counts.live;
        s.counts.liveBytes -= it->second.size;
        s.live.erase(it);
        break;
      }
    }
    if (address != 0) {
      freePoolSegment(address, device);
    }
  }

 private:
  c10::Stream streamOf(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(device);
    if (it == streams_.end()) {
      c10::impl::VirtualGuardImpl impl(c10::kCUDA);
      it = streams_
               .emplace(
                   device,
                   impl.getStreamFromGlobalPool(
                       c10::Device(c10::kCUDA, device),
                       /*isHighPriority=*/true))
               .first;
    }
    return it->second;
  }

  LandingPools pools_;
  std::mutex mu_;
  std::map<c10::DeviceIndex, c10::Stream> streams_;
};

} // namespace

std::shared_ptr<channel::GrantSource> makePoolGrants(
    std::map<int, PoolId> pools) {
  return std::make_shared<PoolGrants>(std::move(pools));
}

} // namespace torch_rpc_ext

using torch_rpc_ext::poolSegments;

extern "C" void* torch_rpc_ext_landing_alloc(
    size_t size,
    int device,
    CUstream) noexcept {
  // Called by torch's caching allocator under its lock: throws nothing;
  // nullptr is torch's out of memory.
  auto& s = poolSegments();
  const uintptr_t p = torch_rpc_ext::channel::cudaMemAlloc(device, size);
  try {
    std::lock_guard<std::mutex> lock(s.mu);
    if (p == 0) {
      ++s.counts.failed;
      return nullptr;
    }
    s.live.emplace(p, torch_rpc_ext::PoolSegment{size, device, s.nextKey++});
    ++s.counts.made;
    ++s.counts.live;
    s.counts.liveBytes += size;
    return reinterpret_cast<void*>(p);
  } catch (...) {
    if (p != 0) {
      std::string error; // not recorded, so not handed out
      torch_rpc_ext::channel::cudaMemFree(device, p, &error);
    }
    return nullptr;
  }
}

extern "C" void torch_rpc_ext_landing_free(
    void* ptr,
    size_t,
    int device,
    CUstream) noexcept {
  auto& s = poolSegments();
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  try {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.live.find(address);
    if (it == s.live.end()) {
      return; // not ours (torch checks its own pointers before this)
    }
    if (it->second.shared > 0) {
      // A peer may have it open: freed when the last no longer may.
      it->second.freed = true;
      return;
    }
    ++s.counts.freed;
    --s.counts.live;
    s.counts.liveBytes -= it->second.size;
    s.live.erase(it);
  } catch (...) {
    return;
  }
  torch_rpc_ext::freePoolSegment(address, device);
}
