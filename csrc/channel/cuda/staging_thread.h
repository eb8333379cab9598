// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <functional>
#include <string>

#include "csrc/channel/cuda/staging_pool.h"

namespace torch_rpc_ext::channel::cuda {

// The one thread of the process that watches the CUDA channels' copies
// complete (cuda_staged's chunks, cuda_ring's slots, releases after a copy
// has read its source) and trims the staging pools. It polls events
// (cuEventQuery: a stream stuck behind the caller's work holds back only its
// own work, and no thread spins inside the driver), sleeping longer while
// nothing completes. What it runs may do anything a normal thread may,
// unlike a CUDA host function, but must not block for long.

// Runs `done("")` on the staging thread once `event` (recorded on a stream
// of `device`) has completed, or `done(<the error>)` if querying it failed.
void whenComplete(
    int device,
    PooledEvent event,
    std::function<void(const std::string& error)> done);

// Runs `fn` on the staging thread soon (what must not run on a transport
// loop: unregistering or freeing pinned memory may wait for the device).
void runOnStagingThread(std::function<void()> fn);

// Runs `fn` on the staging thread once `ready()`, asked there now and then
// (at most every 100 ms once it has said no for a while), returns true. It
// must not block: it polls (cuEventQuery), as the thread does.
void runOnStagingThreadWhen(
    std::function<bool()> ready,
    std::function<void()> fn);

// Runs `release` once the work queued on `stream` (of `device`) so far has
// completed, on the staging thread (also where that work failed: a failed
// stream reads nothing more). Where no event can be recorded, waits for the
// stream here and runs it at once.
void releaseAfter(int device, CUstream stream, std::function<void()> release);

} // namespace torch_rpc_ext::channel::cuda
