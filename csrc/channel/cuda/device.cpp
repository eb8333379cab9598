// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/cuda/device.h"

#include <mutex>
#include <stdexcept>
#include <vector>

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

int deviceCount() {
  int count = 0;
  TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGetCount, &count);
  return count;
}

CUcontext primaryContext(int device) {
  static std::mutex mu;
  static std::vector<CUcontext> contexts;
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= deviceCount()) {
    throw std::out_of_range(
        "CUDA device " + std::to_string(device) + " does not exist (" +
        std::to_string(deviceCount()) + " visible to this process)");
  }
  if (contexts.size() <= static_cast<size_t>(device)) {
    contexts.resize(device + 1, nullptr);
  }
  if (contexts[device] == nullptr) {
    CUdevice dev;
    TORCH_RPC_EXT_CUDA_CHECK(cuDeviceGet, &dev, device);
    TORCH_RPC_EXT_CUDA_CHECK(cuDevicePrimaryCtxRetain, &contexts[device], dev);
  }
  return contexts[device];
}

CurrentDevice::CurrentDevice(int device) {
  CUcontext wanted = primaryContext(device);
  TORCH_RPC_EXT_CUDA_CHECK(cuCtxGetCurrent, &previous_);
  if (previous_ != wanted) {
    TORCH_RPC_EXT_CUDA_CHECK(cuCtxSetCurrent, wanted);
    switched_ = true;
  }
}

CurrentDevice::~CurrentDevice() {
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

} // namespace torch_rpc_ext::channel::cuda
