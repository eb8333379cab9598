// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// Landing memory a receiver grants its peers ahead of their messages
// (docs/cuda.md, "The landing pool", "Grants"), from a pool of torch's CUDA
// caching allocator whose segments are ours. Landings by copy allocate
// from torch's default pool, as without it.
//
// torch makes such a pool from two C functions (torch.cuda.MemPool with a
// CUDAPluggableAllocator naming torch_rpc_ext_landing_alloc and
// torch_rpc_ext_landing_free below): it asks the first for each new segment
// of the pool and gives each back through the second, and it frees none of
// a live pool's segments on its own (torch.cuda.empty_cache() leaves them).
// Blocks of the pool are ordinary caching-allocator memory: record_stream
// works on them, and a freed block is reused on its stream. So memory a
// peer maps can be torch's memory of a received tensor, and is released
// only when we say.
//
// Allocations reach the pool only while routed to it (PoolRouting): a
// grant stream's, in a window around each grant's allocation. torch 2.11
// and 2.12 treat any routing as a CUDA graph capture across the device
// (pytorch#175015), so the window is never left open (and the pool is
// refused there).

#include <cuda.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>

#include "csrc/frame/landed_region.h"

namespace torch_rpc_ext {

namespace channel {
class GrantSource;
} // namespace channel

// torch's c10::MempoolId_t.
using PoolId = std::pair<unsigned long long, unsigned long long>;

// Routes allocations to a pool of torch's CUDA caching allocator: between
// begin() and end(), those of `device` on a stream for which `filter`
// holds come from pool `id`. A pool is routed by one window at a time.
class PoolRouting {
 public:
  using Filter = std::function<bool(CUstream)>;
  virtual ~PoolRouting() = default;
  virtual void begin(c10::DeviceIndex device, PoolId id, Filter filter) = 0;
  // Ends the routing, and drops the use of the pool begin() took.
  virtual void end(c10::DeviceIndex device, PoolId id) = 0;
};

// torch's own routing where this torch has its CUDA caching allocator
// (found at run time: one build serves a CPU torch too), else the one a
// test installed (the fake caching allocator's); nullptr where neither.
PoolRouting* poolRouting();
void setPoolRoutingForTests(PoolRouting* routing);
// torch's, or nullptr (landing_pool_torch.cpp; nullptr too where this
// build had not the CUDA runtime's headers to reach it).
PoolRouting* torchPoolRouting();

// What torch_rpc_ext_landing_alloc made and _free gave back, process-wide.
struct LandingSegmentCounts {
  uint64_t live = 0;
  uint64_t liveBytes = 0;
  uint64_t made = 0;
  uint64_t freed = 0;
  uint64_t failed = 0; // allocations the driver refused (torch: out of memory)
};
LandingSegmentCounts landingSegmentCounts();

// An agent's landing pools, one per device that has one.
class LandingPools {
 public:
  explicit LandingPools(std::map<int, PoolId> pools);
  // `n` bytes from `device`'s pool, for `stream` (made current here: torch
  // allocates for the current stream). Out of memory, it throws as torch's
  // allocator: torch neither frees its default pool's cache nor retries in
  // a window, and a grant is not worth the user's cache (the segment lands
  // by copy instead).
  c10::DataPtr allocate(
      c10::DeviceIndex device,
      const c10::Stream& stream,
      size_t n);

 private:
  const std::map<int, PoolId> pools_;
};

// Blocks allocated from the landing pools, process-wide (each a grant's).
uint64_t landingPoolAllocations();

// A grant's memory (frame::LandedMemory): a block of torch's, which the
// segment written into it becomes (AgentDevices::finish takes it back).
struct TorchLanded final : frame::LandedMemory {
  c10::DataPtr memory;
  void* data() const override {
    return memory.get();
  }
};

// The grant source (channel/grants.h) of an agent with the landing pools
// `pools`: its grants are blocks of them.
std::shared_ptr<channel::GrantSource> makePoolGrants(
    std::map<int, PoolId> pools);

} // namespace torch_rpc_ext

// The pool's segment allocator, as torch's CUDAPluggableAllocator calls it
// (cudaStream_t is CUstream): device memory of `device` (cuMemAlloc), or
// nullptr (torch then reports out of memory); and its release.
extern "C" {
void* torch_rpc_ext_landing_alloc(
    size_t size,
    int device,
    CUstream stream) noexcept;
void torch_rpc_ext_landing_free(
    void* ptr,
    size_t size,
    int device,
    CUstream stream) noexcept;
}
