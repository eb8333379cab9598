// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace torch_rpc_ext::channel::cuda {

// The device memory the CUDA channels hold of their own, outside torch's
// caching allocator: cuda_ipc's blocks (lent to peers, cached while idle)
// and the staging pools' blocks (where staged segments and copies out of
// legacy blocks land before they are copied into torch's memory). Torch's
// allocator usually holds most of a GPU's free memory in its cache, so a
// cuMemCreate or cuMemAlloc of ours can fail while torch could give memory
// back: every such allocation goes through allocate() below, which on
// CUDA_ERROR_OUT_OF_MEMORY has torch free its cached blocks (the agent
// installs how) and tries once more. cuda_ipc's blocks are also bounded per
// device (RpcExtBackendOptions.cuda_ipc_memory_limit); past the bound, or
// still out of memory, cuda_ipc declines the segment and the next device
// channel (cuda_staged) carries it. Process-wide, thread-safe.

struct DeviceMemoryStats {
  uint64_t ipcBytes = 0; // cuda_ipc's own blocks, every device
  uint64_t stagingBytes = 0; // the staging pools' blocks, every device
  uint64_t oomRetries = 0; // allocations retried after torch freed its cache
  uint64_t ipcDeclined = 0; // cuda_ipc blocks not made: bound or memory
  uint64_t grantBytes = 0; // cuda_ipc's grants out, every device
};
DeviceMemoryStats deviceMemoryStats();

// How to have torch give back the cached device memory of `device` (the
// agent's: c10::DeviceAllocator::emptyCache); none by default.
void setCacheRelease(std::function<void(int device)> release);

// The bound, per device, on cuda_ipc's blocks; 0: none.
void setIpcMemoryLimit(uint64_t bytes);
uint64_t ipcMemoryLimit();

// Runs `allocate`; if it throws CudaError CUDA_ERROR_OUT_OF_MEMORY, has
// torch release its cache of `device` and runs it once more (what that
// throws, it throws).
void allocateWithRetry(int device, const std::function<void()>& allocate);

// Accounting of cuda_ipc's blocks: reserveIpc() is false, and counts a
// decline, when `bytes` more on `device` would pass the bound.
bool reserveIpc(int device, uint64_t bytes);
void releaseIpc(int device, uint64_t bytes);
void countIpcDeclined();
// Accounting of cuda_ipc's grants (landing memory granted to peers ahead,
// docs/cuda.md "Grants"): torch's memory, but held by cuda_ipc until a peer
// writes into it, so it counts against the same bound as the blocks.
// Grants take at most half of it, so that a process receiving from many
// peers still has room for blocks of its own sends. reserveGrant() is false
// when `bytes` more on `device` would pass either (the segment then lands
// by copy; nothing is declined); grantRoom() says whether it would not,
// with `freed` bytes of grants given back first.
bool reserveGrant(int device, uint64_t bytes);
void releaseGrant(int device, uint64_t bytes);
bool grantRoom(int device, uint64_t bytes, uint64_t freed);
void addStagingBytes(int64_t delta);

} // namespace torch_rpc_ext::channel::cuda
