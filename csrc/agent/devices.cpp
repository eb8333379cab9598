// SPDX-License-Identifier: BSD-3-Clause
// The agent's CUDA side: devices.h.
#include "csrc/agent/devices.h"

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <optional>

#include "csrc/channel/registry.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

rpc::DeviceMap AgentDevices::mapTo(const std::string& name) const {
  auto it = options_.deviceMaps.find(name);
  return it == options_.deviceMaps.end() ? rpc::DeviceMap{} : it->second;
}

void AgentDevices::recordCudaUse(const rpc::Message& message) {
  std::optional<c10::impl::VirtualGuardImpl> impl;
  for (const auto& t : message.tensors()) {
    if (t.is_cuda()) {
      if (!impl) {
        impl.emplace(c10::kCUDA);
      }
      impl->recordDataPtrOnStream(
          t.storage().data_ptr(), impl->getStream(t.device()));
    }
  }
}

void AgentDevices::useTorchForChannelMemory() const {
  // Process-wide: the last agent's options stand (one agent per process).
  channel::setCudaMemoryPolicy(options_.cudaIpcMemoryLimit, [](int) {
    // Torch's allocator frees every device's unused cached blocks (torch
    // has no per-device call); one that is not a DeviceAllocator has none.
    try {
      if (auto* a = dynamic_cast<c10::DeviceAllocator*>(
              c10::GetAllocator(c10::kCUDA))) {
        a->emptyCache();
      }
    } catch (const std::exception& e) {
      logWarning(
          std::string(
              "torch_rpc_ext: freeing torch's cached CUDA memory "
              "failed: ") +
          e.what());
    }
  });
}

std::vector<c10::DataPtr> AgentDevices::land(
    const c10::Stream& stream,
    const std::vector<std::pair<uintptr_t, size_t>>& spans) {
  std::vector<c10::DataPtr> out;
  out.reserve(spans.size());
  std::vector<channel::DeviceCopy> copies;
  copies.reserve(spans.size());
  uint64_t bytes = 0;
  {
    // Torch's caching allocator takes the current stream as the one the
    // memory is used on: a block freed on it is reused on it at once, and
    // on any other only after the streams recorded on it (record_stream,
    // a future's wait()) have passed the free.
    c10::StreamGuard guard(stream);
    c10::Allocator* allocator = c10::GetAllocator(c10::kCUDA);
    // Our thread, in relaxed capture mode: a user's global-mode capture
    // elsewhere stays valid.
    channel::withRelaxedCudaCapture([&] {
      for (const auto& [address, size] : spans) {
        out.push_back(allocator->allocate(size));
        copies.push_back(
            {reinterpret_cast<uintptr_t>(out.back().get()), address, size});
        bytes += size;
      }
    });
  }
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  channel::copyOnCudaDevice(
      stream.device_index(),
      reinterpret_cast<uintptr_t>(impl.getStreamNativeHandle(stream)),
      copies);
  landings_.fetch_add(1, std::memory_order_relaxed);
  landed_.fetch_add(spans.size(), std::memory_order_relaxed);
  landedBytes_.fetch_add(bytes, std::memory_order_relaxed);
  return out;
}

std::vector<c10::Stream> AgentDevices::arrivalStreams() const {
  std::vector<c10::Stream> out;
  if (options_.devices.empty()) {
    return out; // (finish() then names the device no stream is for)
  }
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  for (const auto& d : options_.devices) {
    out.push_back(impl.getStreamFromGlobalPool(d));
  }
  return out;
}

wire::DeviceRoute AgentDevices::routeTo(
    const std::string& peer,
    const rpc::DeviceMap& map) const {
  wire::DeviceRoute route;
  route.map = map;
  route.peer = peer;
  // A tensor's bytes are read on the sender's current stream of its device,
  // after whatever it queued there (recordCudaUse() tells the caching
  // allocator, so a storage freed meanwhile is not reused before the copy
  // is done).
  route.readyStream = [](c10::Device device) {
    c10::impl::VirtualGuardImpl impl(c10::kCUDA);
    return reinterpret_cast<uintptr_t>(
        impl.getStreamNativeHandle(impl.getStream(device)));
  };
  return route;
}

c10::intrusive_ptr<rpc::Message> AgentDevices::finish(
    wire::InboundMessage& in,
    frame::InboundBuffers& buffers,
    std::vector<c10::Stream>& streams) {
  if (!in.cudaDevices().empty()) {
    streams = arrivalStreams();
  }
  auto streamOf = [&](c10::DeviceIndex device) -> const c10::Stream& {
    for (const auto& s : streams) {
      if (s.device_index() == device) {
        return s;
      }
    }
    TORCH_CHECK(
        false,
        "a tensor arrived on cuda:",
        int(device),
        ", which is not among the devices of ",
        self_);
  };
  wire::InboundMessage::DeviceLanding landing;
  if (!options_.cudaZeroCopy) {
    landing = [&](c10::DeviceIndex device,
                  uintptr_t,
                  const std::vector<std::pair<uintptr_t, size_t>>& spans) {
      return land(streamOf(device), spans);
    };
  }
  return in.finish(
      buffers,
      [&](c10::DeviceIndex device) {
        c10::impl::VirtualGuardImpl impl(c10::kCUDA);
        return reinterpret_cast<uintptr_t>(
            impl.getStreamNativeHandle(streamOf(device)));
      },
      landing);
}

void AgentDevices::addMetrics(
    std::unordered_map<std::string, std::string>& m) const {
  const auto d = channel::cudaMemoryStats();
  m["rpc_ext.cuda.ipc_block_bytes"] = std::to_string(d.ipcBlockBytes);
  m["rpc_ext.cuda.staging_block_bytes"] = std::to_string(d.stagingBlockBytes);
  m["rpc_ext.cuda.oom_retries"] = std::to_string(d.oomRetries);
  m["rpc_ext.cuda.ipc_declined_memory"] = std::to_string(d.ipcDeclined);
  m["rpc_ext.cuda.landing_launches"] = std::to_string(landings_.load());
  m["rpc_ext.cuda.landed_segments"] = std::to_string(landed_.load());
  m["rpc_ext.cuda.landed_bytes"] = std::to_string(landedBytes_.load());
}

} // namespace torch_rpc_ext
