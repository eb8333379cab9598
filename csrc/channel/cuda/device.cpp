// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/cuda/device.h"

#include <atomic>
#include <mutex>
#include <stdexcept>

#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

int attribute(int device, CUdevice_attribute which) {
  CUdevice dev;
  TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGet, &dev, device);
  int value = 0;
  TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGetAttribute, &value, which, dev);
  return value;
}

} // namespace

// Primary contexts by device index: leaked, so the destructors of static
// objects holding device memory can still switch contexts at exit; read
// without a lock once set (every launch makes one current).
constexpr int kMaxDevices = 64;
struct Contexts {
  std::mutex mu;
  std::atomic<CUcontext> byDevice[kMaxDevices] = {};
};

Contexts& contexts() {
  static Contexts* c = new Contexts();
  return *c;
}

int deviceCount() {
  // Fixed for the life of the process (CUDA_VISIBLE_DEVICES is read once,
  // at cuInit).
  static const int count = [] {
    int n = 0;
    TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGetCount, &n);
    return n;
  }();
  return count;
}

CUcontext primaryContext(int device) {
  if (device < 0 || device >= deviceCount() || device >= kMaxDevices) {
    throw std::out_of_range(
        "CUDA device " + std::to_string(device) + " does not exist (" +
        std::to_string(deviceCount()) + " visible to this process)");
  }
  Contexts& c = contexts();
  CUcontext ctx = c.byDevice[device].load(std::memory_order_acquire);
  if (ctx != nullptr) {
    return ctx;
  }
  std::lock_guard<std::mutex> lock(c.mu);
  ctx = c.byDevice[device].load(std::memory_order_relaxed);
  if (ctx == nullptr) {
    CUdevice dev;
    TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGet, &dev, device);
    TORCH_RPC_EXT_CUDA_CHECK(cuDevicePrimaryCtxRetain, &ctx, dev);
    c.byDevice[device].store(ctx, std::memory_order_release);
  }
  return ctx;
}

namespace {

// Guards of this thread now open: an inner one finds the mode and the
// context its outer one set, and makes no driver call (a message opens
// them nested many times over).
thread_local int t_relaxedDepth = 0;
thread_local CUcontext t_guardContext = nullptr;

} // namespace

RelaxedCapture::RelaxedCapture() {
  if (t_relaxedDepth == 0) {
    TORCH_RPC_EXT_CUDA_CHECK(cuThreadExchangeStreamCaptureMode, &previous_);
  }
  ++t_relaxedDepth;
}

RelaxedCapture::~RelaxedCapture() {
  if (--t_relaxedDepth == 0) {
    libcuda().cuThreadExchangeStreamCaptureMode(&previous_);
  }
}

CurrentDevice::CurrentDevice(int device) {
  CUcontext wanted = primaryContext(device);
  outer_ = t_guardContext;
  if (outer_ == wanted) {
    return; // an enclosing guard of this thread made it current
  }
  TORCH_RPC_EXT_CUDA_CHECK(cuCtxGetCurrent, &previous_);
  if (previous_ != wanted) {
    TORCH_RPC_EXT_CUDA_CHECK(cuCtxSetCurrent, wanted);
    // Restored after, even to none: a thread that runs users' functions
    // (a loop, the serving pool) must keep the device torch's runtime
    // would report there (cudaGetDevice follows the current context).
    switched_ = true;
  }
  t_guardContext = wanted;
}

CurrentDevice::~CurrentDevice() {
  if (t_guardContext == outer_) {
    return; // nested in a guard of the same device
  }
  t_guardContext = outer_;
  if (switched_) {
    libcuda().cuCtxSetCurrent(previous_); // Nothing to do if it fails.
  }
}

std::string deviceUuid(int device) {
  CUdevice dev;
  TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGet, &dev, device);
  CUuuid uuid;
  TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGetUuid, &uuid, dev);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (char byte : uuid.bytes) {
    auto b = static_cast<unsigned char>(byte);
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

int multiprocessors(int device) {
  return attribute(device, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
}

bool supportsFdExport(int device) {
  return attribute(
             device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) !=
      0 &&
      attribute(
          device,
          CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) != 0;
}

bool supportsIpcEvents(int device) {
  return attribute(device, CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED) != 0;
}

bool supportsLegacyIpc(int device) {
  return attribute(device, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) != 0;
}

std::string noCudaDeviceReason() {
  try {
    if (deviceCount() == 0) {
      return "no CUDA device is visible to this process";
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool canAccessPeer(int device, int peer) {
  if (device == peer) {
    return false;
  }
  CUdevice a;
  CUdevice b;
  TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGet, &a, device);
  TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGet, &b, peer);
  int can = 0;
  TORCH_RPC_EXT_CUDA_CHECK(cuDeviceCanAccessPeer, &can, a, b);
  return can != 0;
}

} // namespace torch_rpc_ext::channel::cuda
