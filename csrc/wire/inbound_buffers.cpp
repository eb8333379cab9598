// SPDX-License-Identifier: BSD-3-Clause
// InboundMessage (codec.h): where its segments go (buffers()), the payload
// taken out of the memory a channel provided, and the message without its
// tensors that a failed receive answers from. Parsing: inbound.cpp.
#include <ATen/ATen.h>

#include "csrc/wire/codec.h"

namespace torch_rpc_ext::wire {

frame::InboundBuffers InboundMessage::buffers(
    const std::shared_ptr<InboundMessage>& self) {
  frame::InboundBuffers b;
  b.segments.reserve(1 + storages_.size());
  b.segments.push_back(payload_.empty() ? nullptr : payload_.data());
  for (auto& s : storages_) {
    b.segments.push_back(s ? s.mutable_data() : nullptr);
  }
  if (!cudaDevices_.empty()) {
    // Where a staging channel lands each segment's bytes.
    b.devices.reserve(b.segments.size());
    b.devices.push_back(-1);
    for (int8_t d : segmentDevices_) {
      b.devices.push_back(d >= 0 ? d : -1);
    }
  }
  b.keepAlive = self;
  return b;
}

void InboundMessage::adoptPayload(const frame::InboundBuffers& buffers) {
  if (payloadAdopted_ || buffers.regions.empty() ||
      buffers.regions[0] == nullptr || sizes_.empty()) {
    return;
  }
  TORCH_CHECK(
      dynamic_cast<frame::DeviceRegion*>(buffers.regions[0].get()) == nullptr,
      "the message payload arrived in device memory");
  // The payload is parsed from a vector: one copy, and the slab goes back
  // at once.
  const char* p = static_cast<const char*>(buffers.provided[0]);
  payload_.assign(p, p + sizes_[0]);
  payloadAdopted_ = true;
}

c10::intrusive_ptr<rpc::Message> InboundMessage::withoutTensors() const {
  std::vector<at::Tensor> placeholders(tensors_.size(), at::empty({0}));
  return c10::make_intrusive<rpc::Message>(
      std::vector<char>(payload_), std::move(placeholders), type_, id_);
}

} // namespace torch_rpc_ext::wire
