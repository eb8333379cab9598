// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <array>
#include <cstdint>
#include <string>

namespace torch_rpc_ext::channel::cuda {

// Facts about one CUDA device and the driver state a thread needs to use it,
// all through the run-time driver table (csrc/common/libcuda.h).
//
// Every thread that calls the driver needs a current context: a new thread
// has none, and c10's SetDevice returns early when the device index already
// matches (cuda-design.md, pitfall 2). The extension uses the devices'
// primary contexts only, the ones the CUDA runtime and torch use, so handles
// opened or modules loaded here are valid for torch's streams and memory.

// The device's primary context, retained on first use and kept for the life
// of the process (released by the driver at exit; never from a static
// destructor). Throws naming the device if it does not exist.
CUcontext primaryContext(int device);

// Relaxed stream capture mode on this thread for the guard's life
// (cuThreadExchangeStreamCaptureMode), then the mode it had. While a user's
// stream captures a CUDA graph in global mode (torch.cuda.graph's default),
// a potentially unsafe call (cuEventQuery, cuMemAlloc, a free, a
// synchronisation) from any thread in global mode fails and invalidates
// that capture, as PyTorch found with its NCCL watchdog. Our calls never
// touch a capturing stream: every one runs under this guard, most through
// CurrentDevice.
//
// Makes `device`'s primary context current on this thread for the guard's
// life, then restores the one that was current (or none); relaxed
// meanwhile. Nested guards of one thread and device make no driver call.
class RelaxedCapture {
 public:
  RelaxedCapture();
  ~RelaxedCapture();
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  CUstreamCaptureMode previous_ = CU_STREAM_CAPTURE_MODE_RELAXED;
};

class CurrentDevice {
 public:
  explicit CurrentDevice(int device);
  ~CurrentDevice();
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  RelaxedCapture relaxed_;
  CUcontext previous_ = nullptr;
  CUcontext outer_ = nullptr; // an enclosing guard's of this thread
  bool switched_ = false;
};

int deviceCount();
// Why a CUDA channel cannot work in this process: the driver does not load
// (its error), or it sees no device; "" when it can. Loads the driver.
std::string noCudaDeviceReason();

// The device's UUID, which names it across processes whatever their
// CUDA_VISIBLE_DEVICES (pitfall 11), as 32 hex digits.
std::string deviceUuid(int device);

int multiprocessors(int device);

// Whether the device can create memory (cuMemCreate) that exports as a POSIX
// file descriptor: what the cuda_ipc channel's shared blocks need.
bool supportsFdExport(int device);

// Whether the device has interprocess events (cuIpcGetEventHandle): every
// cuda_ipc block orders its writer and readers by a pair of them. vGPU, WSL
// and confidential-computing devices may lack them while they export
// memory.
bool supportsIpcEvents(int device);

// Whether the device's cuMemAlloc memory can be shared through legacy IPC
// handles (cuIpcGetMemHandle): a unified address space, which every 64-bit
// Linux device has. What cuda_ipc falls back on where fd export is missing.
bool supportsLegacyIpc(int device);

// Whether `device` can read and write memory that lives on `peer` (NVLink
// or PCIe peer-to-peer: cuDeviceCanAccessPeer); false for the same device.
// What lets cuda_ipc land a block of the peer's cuda:x on our cuda:y.
bool canAccessPeer(int device, int peer);

} // namespace torch_rpc_ext::channel::cuda
