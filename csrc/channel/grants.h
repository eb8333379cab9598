// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// Landing memory a receiver grants its peer ahead of its messages
// (docs/cuda.md, "Grants"; cuda_ipc carries them, channel/cuda_ipc/
// ipc_grants.cpp; this seam is what the agent sees of them): the sender writes
// a large segment straight into it, and the receiver's tensor is that memory,
// with no landing copy. The memory is torch's (a block of the landing pool,
// agent/landing_pool.h), so the agent provides it: it installs a GrantSource
// when it has a landing pool; without one, cuda_ipc grants nothing.

#include <cuda.h>

#include <cstdint>
#include <memory>

#include "csrc/frame/landed_region.h"

namespace torch_rpc_ext::channel {

struct GrantMemory {
  std::unique_ptr<frame::LandedMemory> memory; // the agent's (torch's)
  // The stream it was allocated for: the peer writes only after the work
  // queued there by then (the block's last use) has completed.
  CUstream stream = nullptr;
  // The pool segment holding it (what a legacy handle names), and its key,
  // unique per allocation of a segment.
  uintptr_t segmentBase = 0;
  uint64_t segmentSize = 0;
  uint64_t segmentKey = 0;
};

class GrantSource {
 public:
  virtual ~GrantSource() = default;
  // `bytes` of `device` from the landing pool; throws as torch's allocator.
  // (The channel layer knows no torch: the memory is the agent's to
  // interpret when the segment lands in it.)
  virtual GrantMemory allocate(int device, uint64_t bytes) = 0;
  // A peer may now have segment `key` open / no longer has: the segment's
  // memory is not freed while any may (cuda.h: cuMemFree before the
  // importer's cuIpcCloseMemHandle is undefined).
  virtual void segmentShared(uint64_t key) = 0;
  virtual void segmentUnshared(uint64_t key) = 0;
};

// Process-wide; the last agent's stands (one agent per process).
void setGrantSource(std::shared_ptr<GrantSource> source);
std::shared_ptr<GrantSource> grantSource();

// A grant the peer has not used for this long is taken back, its memory the
// pool's again and out of the device's bound, as idle blocks are dropped
// ($TORCH_RPC_EXT_CUDA_GRANT_IDLE_MS, 0..3600000, read when cuda_ipc is
// probed; 0: kept until outgrown or the close). A segment of its size later
// lands by copy once and earns a grant again. Process-wide.
constexpr int64_t kDefaultGrantIdleMs = 10000;
void setGrantIdleMs(int64_t ms);
int64_t grantIdleMs();

} // namespace torch_rpc_ext::channel
