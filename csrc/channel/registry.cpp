// SPDX-License-Identifier: BSD-3-Clause
// The one file that knows every channel: a new channel is a folder of its own
// (or a class in one) plus one line in kChannels.
#include "csrc/channel/registry.h"

#include <algorithm>
#include <functional>
#include <iterator>
#include <memory>
#include <stdexcept>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/device_memory.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/channel/cuda_ring/cuda_ring_channel.h"
#include "csrc/channel/cuda_self/self_channel.h"
#include "csrc/channel/cuda_staged/staged_channel.h"
#include "csrc/channel/lanes/factory.h"
#include "csrc/channel/shm/factory.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::channel {

namespace {

struct Entry {
  const char* name;
  DeviceKind device; // Context::device() of what it creates
  std::shared_ptr<Context> (*create)(WireIds);
  // Its place in the default preference order (the options' defaults, the
  // names listed), apart from its place in kChannels, which is its wire id.
  int preference;
  bool byDefault = true; // in the `channels` option's default
};

// In default preference order: a segment is offered to the channels of its
// device in this order, and the stream takes what none took.
// In the order of their wire ids (position + 1, docs/wire-format.md): a
// new channel goes last, whatever its preference.
constexpr Entry kChannels[] = {
    {"shm_slab", DeviceKind::kCpu, shm::createSlabChannel, 0},
    {"shm_ring", DeviceKind::kCpu, shm::createRingChannel, 1},
    {"cuda_ipc", DeviceKind::kCuda, cuda::createIpcChannel, 2},
    {"cuda_staged", DeviceKind::kCuda, cuda::createStagedChannel, 5},
    // Striped over TCP lanes: only a connection with IP addresses uses it.
    // Opt in: more sockets, threads and ports per peer, for hosts with
    // cores to spare on fat links (docs/guide.md, "Fat links").
    {"tcp_lanes", DeviceKind::kCpu, lanes::createLanesChannel, 6, false},
    // A worker's calls to itself only (its descriptor names the process),
    // preferred to cuda_staged, which would take them through host memory.
    {"cuda_self", DeviceKind::kCuda, cuda::createSelfChannel, 3},
    // One host, through a shared pinned ring, where cuda_ipc cannot join
    // the two processes' devices: preferred to cuda_staged's socket.
    {"cuda_ring", DeviceKind::kCuda, cuda::createRingChannel, 4},
};

// The entries by preference.
std::vector<const Entry*> byPreference() {
  std::vector<const Entry*> out;
  for (const auto& e : kChannels) {
    out.push_back(&e);
  }
  std::stable_sort(out.begin(), out.end(), [](const Entry* a, const Entry* b) {
    return a->preference < b->preference;
  });
  return out;
}

} // namespace

std::vector<std::string> channelNames(std::optional<DeviceKind> device) {
  std::vector<std::string> names;
  for (const Entry* e : byPreference()) {
    if (!device || e->device == *device) {
      names.emplace_back(e->name);
    }
  }
  return names;
}

std::vector<std::string> defaultChannelNames(DeviceKind device) {
  std::vector<std::string> names;
  for (const Entry* e : byPreference()) {
    if (e->device == device && e->byDefault) {
      names.emplace_back(e->name);
    }
  }
  return names;
}

static_assert(
    std::size(kChannels) <= frame::kMaxChannels,
    "no frame kinds left for another channel");

std::shared_ptr<Context> createChannel(const std::string& name) {
  for (size_t i = 0; i < std::size(kChannels); ++i) {
    if (name == kChannels[i].name) {
      // By position: both ends of a connection run the same list.
      WireIds ids;
      ids.channel = static_cast<uint8_t>(i + 1);
      ids.firstKind = static_cast<uint8_t>(
          frame::kFirstChannelFrameKind + i * frame::kFrameKindsPerChannel);
      return kChannels[i].create(ids);
    }
  }
  throw std::invalid_argument("unknown channel '" + name + "'");
}

void setCudaKernels(
    const std::map<std::string, std::pair<std::string, std::string>>& kernels) {
  cuda::KernelImages images;
  for (const auto& [name, image] : kernels) {
    images[name] = cuda::KernelImage{image.first, image.second};
  }
  cuda::setKernelImages(std::move(images));
}

void copyOnCudaDevice(
    int device,
    uintptr_t stream,
    const std::vector<DeviceCopy>& copies) {
  std::vector<cuda::CopyEngine::Segment> segments;
  segments.reserve(copies.size());
  for (const auto& c : copies) {
    segments.push_back(
        {static_cast<CUdeviceptr>(c.dst),
         static_cast<CUdeviceptr>(c.src),
         c.bytes});
  }
  cuda::CurrentDevice current(device);
  cuda::copyEngine(device).copySegments(
      reinterpret_cast<CUstream>(stream), segments);
}

void copyToHost(
    int device,
    uintptr_t stream,
    void* dst,
    uintptr_t src,
    size_t bytes) {
  if (bytes == 0) {
    return;
  }
  cuda::CurrentDevice current(device);
  auto s = reinterpret_cast<CUstream>(stream);
  TORCH_RPC_EXT_CUDA_CHECK(
      cuMemcpyDtoHAsync, dst, static_cast<CUdeviceptr>(src), bytes, s);
}

void waitForStream(int device, uintptr_t stream) {
  cuda::CurrentDevice current(device);
  TORCH_RPC_EXT_CUDA_CHECK(
      cuStreamSynchronize, reinterpret_cast<CUstream>(stream));
}

void copyToDevice(
    int device,
    uintptr_t stream,
    uintptr_t dst,
    const void* src,
    size_t bytes,
    std::function<void()> done) {
  auto s = reinterpret_cast<CUstream>(stream);
  try {
    cuda::CurrentDevice current(device);
    if (bytes != 0) {
      TORCH_RPC_EXT_CUDA_CHECK(
          cuMemcpyHtoDAsync, static_cast<CUdeviceptr>(dst), src, bytes, s);
    }
  } catch (...) {
    done(); // nothing was queued
    throw;
  }
  // The source is held until the stream has read it (the fake driver, like
  // a real one with pinned memory, reads it when the copy runs), then let go
  // on the staging thread: not in a host function, where a storage's last
  // release (a shared slab's, which writes to its connection) must not run.
  cuda::releaseAfter(device, s, std::move(done));
}

uintptr_t cudaMemAlloc(int device, size_t bytes) noexcept {
  try {
    cuda::CurrentDevice current(device);
    CUdeviceptr p = 0;
    return libcuda().cuMemAlloc(&p, bytes) == CUDA_SUCCESS ? p : 0;
  } catch (...) {
    return 0;
  }
}

bool cudaMemFree(int device, uintptr_t address, std::string* error) noexcept {
  try {
    cuda::CurrentDevice current(device);
    const CUresult rc = libcuda().cuMemFree(address);
    if (rc == CUDA_SUCCESS || rc == CUDA_ERROR_DEINITIALIZED) {
      return true;
    }
    *error = cudaErrorText("cuMemFree", rc);
  } catch (const std::exception& e) {
    *error = e.what();
  } catch (...) {
    *error = "unknown error";
  }
  return false;
}

void warmCudaDevice(int device) {
  cuda::CurrentDevice current(device);
  cuda::copyEngine(device);
}

CudaDeviceScope::CudaDeviceScope(int device)
    : current_(std::make_unique<cuda::CurrentDevice>(device)) {}

CudaDeviceScope::~CudaDeviceScope() = default;

void withRelaxedCudaCapture(const std::function<void()>& fn) {
  cuda::RelaxedCapture relaxed;
  fn();
}

CudaMemoryStats cudaMemoryStats() {
  const auto d = cuda::deviceMemoryStats();
  return {
      d.ipcBytes, d.stagingBytes, d.oomRetries, d.ipcDeclined, d.grantBytes};
}

void setCudaMemoryPolicy(
    uint64_t ipcLimitBytes,
    std::function<void(int device)> releaseCache) {
  cuda::setIpcMemoryLimit(ipcLimitBytes);
  cuda::setCacheRelease(std::move(releaseCache));
}

} // namespace torch_rpc_ext::channel
