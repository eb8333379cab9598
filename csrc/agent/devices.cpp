// SPDX-License-Identifier: BSD-3-Clause
// The agent's CUDA side (docs/cuda.md, "The agent's CUDA path"): its devices
// and maps, the streams tensors arrive on, how they leave.
#include <c10/core/impl/VirtualGuardImpl.h>

#include <optional>

#include "csrc/agent/agent.h"

namespace torch_rpc_ext {

rpc::DeviceMap Agent::getDeviceMap(const rpc::WorkerInfo& dst) const {
  auto it = options_.deviceMaps.find(dst.name_);
  return it == options_.deviceMaps.end() ? rpc::DeviceMap{} : it->second;
}

void Agent::recordCudaUse(const rpc::Message& message) {
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

std::vector<c10::Stream> Agent::arrivalStreams() const {
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

wire::DeviceRoute Agent::routeTo(const Peer& peer, const rpc::DeviceMap& map)
    const {
  wire::DeviceRoute route;
  route.map = map;
  route.peer = peer.info.name_;
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

} // namespace torch_rpc_ext
