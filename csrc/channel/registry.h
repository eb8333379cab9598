// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "csrc/channel/channel.h"

namespace torch_rpc_ext::channel {

// What the stream itself is called where channels are listed: it carries
// every segment no channel takes, on every transport, and is not negotiated.
inline constexpr const char* kStreamChannelName = "basic";

// Names of the out-of-band channels this build has (of one device kind, or
// all), in default preference order.
std::vector<std::string> channelNames(
    std::optional<DeviceKind> device = std::nullopt);

// Those of `device` that the options use unless told otherwise (all but
// the opt-in ones, such as tcp_lanes), in preference order.
std::vector<std::string> defaultChannelNames(DeviceKind device);

// A new channel context by name, with the wire ids of its position in the
// list; throws std::invalid_argument for an unknown name.
std::shared_ptr<Context> createChannel(const std::string& name);

// The CUDA channels' copy kernels, {name: (mangled entry, PTX)}, as
// torch_rpc_ext._cuda.ptx compiles them: needed before a CUDA tensor moves.
void setCudaKernels(
    const std::map<std::string, std::pair<std::string, std::string>>& kernels);

// The CUDA channels' device side that the agent uses (channel/cuda/), for
// the tensors it lands in torch's memory and for its metrics.
struct DeviceCopy {
  uintptr_t dst;
  uintptr_t src;
  uint64_t bytes;
};
// `copies` (device memory of `device`) with one launch of the copy kernels
// on `stream` (a CUstream), queued after the stream's work so far.
void copyOnCudaDevice(
    int device,
    uintptr_t stream,
    const std::vector<DeviceCopy>& copies);
// Between host and device memory of `device`, on `stream` (a CUstream),
// after the stream's work so far: for device maps between the CPU and a
// GPU. copyToHost() queues the copy (waitForStream() waits for it);
// copyToDevice() returns at once and runs `done` on the staging thread
// (cuda/staging_thread.h, releaseAfter) once the copy has read `src`.
void copyToHost(
    int device,
    uintptr_t stream,
    void* dst,
    uintptr_t src,
    size_t bytes);
void waitForStream(int device, uintptr_t stream);
void copyToDevice(
    int device,
    uintptr_t stream,
    uintptr_t dst,
    const void* src,
    size_t bytes,
    std::function<void()> done);
// Makes the first CUDA tensor on `device` cheap: the device's primary
// context retained and current-able, and the copy engine's kernels loaded
// (a JIT compile of their PTX), on the calling thread rather than a
// transport loop's as the first message arrives.
void warmCudaDevice(int device);
namespace cuda {
class CurrentDevice;
}
// `device`'s context current on this thread, in relaxed stream capture
// mode, for the scope's life (cuda/device.h, CurrentDevice): the guards of
// the channels and the copy engine inside it make no driver call. Only
// around work on that one device: a guard inside for another device, or
// torch switching devices meanwhile, would undo what it saves.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device);
  ~CudaDeviceScope();
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  std::unique_ptr<cuda::CurrentDevice> current_;
};
// Runs `fn` with this thread in relaxed stream capture mode, so that its
// driver calls cannot invalidate a user's global-mode CUDA graph capture
// (channel/cuda/device.h, RelaxedCapture).
void withRelaxedCudaCapture(const std::function<void()>& fn);
// The device memory the CUDA channels hold of their own
// (channel/cuda/device_memory.h).
struct CudaMemoryStats {
  uint64_t ipcBlockBytes = 0;
  uint64_t stagingBlockBytes = 0;
  uint64_t oomRetries = 0;
  uint64_t ipcDeclined = 0;
  uint64_t grantBytes = 0; // cuda_ipc's grants out (torch's memory)
};
CudaMemoryStats cudaMemoryStats();
// Device memory of `device` (cuMemAlloc), or 0 where the driver refuses;
// and its release, false with `error` set where the driver refuses that
// (a driver already shut down at exit is not refused). Neither throws: the
// landing pool's segments (agent/landing_pool.h), which torch asks for and
// gives back under its allocator's lock.
uintptr_t cudaMemAlloc(int device, size_t bytes) noexcept;
bool cudaMemFree(int device, uintptr_t address, std::string* error) noexcept;
// cuda_ipc's bound per device (0: none), and how to have torch give back
// its cached device memory when an allocation of ours is out of memory.
void setCudaMemoryPolicy(
    uint64_t ipcLimitBytes,
    std::function<void(int device)> releaseCache);

} // namespace torch_rpc_ext::channel
