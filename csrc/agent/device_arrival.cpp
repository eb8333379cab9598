// SPDX-License-Identifier: BSD-3-Clause
// The agent's CUDA side for a message that arrived (devices.h): its devices
// checked against ours, its tensors made on the arrival streams from the
// channels' regions, a failure named as the receiver's.
#include "csrc/agent/devices.h"

#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <optional>

#include "csrc/agent/landing_pool.h"
#include "csrc/channel/registry.h"
#include "csrc/frame/landed_region.h"

namespace torch_rpc_ext {

template <typename Fn>
auto AgentDevices::local(const std::string& what, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const ReceiveFailure&) {
    throw;
  } catch (const c10::Error& e) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    throw ReceiveFailure(what + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    throw ReceiveFailure(what + ": " + e.what());
  }
}

bool AgentDevices::serves(int d) const {
  return std::any_of(
      options_.devices.begin(),
      options_.devices.end(),
      [&](const c10::Device& ours) {
        return ours.is_cuda() && ours.index() == d;
      });
}

int AgentDevices::unserved(const wire::InboundMessage& in) const {
  for (const c10::DeviceIndex d : in.cudaDevices()) {
    if (!serves(d)) {
      return d;
    }
  }
  return -1;
}

void AgentDevices::markUnserved(
    const wire::InboundMessage& in,
    frame::InboundBuffers& b) const {
  if (unserved(in) < 0) {
    return;
  }
  for (int8_t& d : b.devices) {
    if (d >= 0 && !serves(d)) {
      d = frame::kDeviceNotServed;
    }
  }
}

c10::intrusive_ptr<rpc::Message> AgentDevices::finish(
    wire::InboundMessage& in,
    frame::InboundBuffers& buffers,
    std::vector<c10::Stream>& streams,
    int32_t peer) {
  // Before anything can fail: a failed remote() call's OwnerRRef is made
  // from the payload (Agent::failReceive).
  in.adoptPayload(buffers);
  // (Before the channels' regions are looked at: theirs would say less.)
  if (const int d = unserved(in); d >= 0) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    throw ReceiveFailure(
        "a tensor arrived for cuda:" + std::to_string(d) +
        ", which is not among the devices of " + self_ +
        " (the sender's device map names it)");
  }
  if (!in.cudaDevices().empty()) {
    streams = local("no CUDA stream for the message's tensors", [&] {
      return arrivalStreams();
    });
  }
  auto streamOf = [&](c10::DeviceIndex device) -> const c10::Stream& {
    for (const auto& s : streams) {
      if (s.device_index() == device) {
        return s;
      }
    }
    failures_.fetch_add(1, std::memory_order_relaxed);
    throw ReceiveFailure(
        "a tensor arrived for cuda:" + std::to_string(int(device)) +
        ", which is not among the devices of " + self_);
  };
  auto sizeOf = [](const auto& items, auto bytes) {
    uint64_t n = 0;
    for (const auto& i : items) {
      n += bytes(i);
    }
    return std::to_string(items.size()) + " CUDA segment(s) of " +
        std::to_string(n) + " bytes";
  };
  wire::InboundMessage::DeviceLanding landing;
  if (!options_.cudaZeroCopy) {
    landing = [&](c10::DeviceIndex device,
                  uintptr_t,
                  const std::vector<std::pair<uintptr_t, size_t>>& spans)
        -> wire::InboundMessage::Landed {
      const c10::Stream& stream = streamOf(device);
      return local(
          "landing " +
              sizeOf(spans, [](const auto& s) { return uint64_t(s.second); }) +
              " on cuda:" + std::to_string(int(device)) + " failed",
          [&] { return land(landingFor(device, peer), stream, spans); });
    };
  }
  auto hostLanding = [&](c10::DeviceIndex device,
                         uintptr_t,
                         const std::vector<c10::Storage>& hosts) {
    const c10::Stream& stream = streamOf(device);
    return local(
        "copying " +
            sizeOf(hosts, [](const auto& h) { return uint64_t(h.nbytes()); }) +
            " from host memory onto cuda:" + std::to_string(int(device)) +
            " failed",
        [&] { return landFromHost(stream, hosts); });
  };
  // The tensors are built under the arrival streams: what building reads
  // on the device (a sparse tensor's indices, validated) is ordered after
  // the landing's copies and the regions' readiness.
  std::optional<c10::MultiStreamGuard> onArrival;
  if (!streams.empty()) {
    local("no CUDA stream for the message's tensors", [&] {
      onArrival.emplace(streams);
    });
  }
  // A message of one device (the usual) lands under one hold of its
  // context: the channels' guards inside (the landing's allocation and
  // copy, each region's wait and release) then make no driver call of
  // their own, where each made two to four.
  // The device is made current through torch first, so that torch's own
  // guards inside (the landing's stream guard, its events) restore that
  // device, never the one before: a guard of ours nested in the hold
  // trusts that the context it holds is still current.
  std::optional<c10::DeviceGuard> torchDevice;
  std::optional<channel::CudaDeviceScope> onDevice;
  // (Only on a device of ours: another fails below, touching nothing.)
  if (in.cudaDevices().size() == 1 &&
      std::any_of(streams.begin(), streams.end(), [&](const c10::Stream& s) {
        return s.device_index() == in.cudaDevices().front();
      })) {
    local("no CUDA context for the message's tensors", [&] {
      torchDevice.emplace(c10::Device(c10::kCUDA, in.cudaDevices().front()));
      onDevice.emplace(in.cudaDevices().front());
    });
  }
  try {
    auto message = in.finish(
        buffers,
        [&](c10::DeviceIndex device) {
          // (streamOf first: a device not ours is a ReceiveFailure, even
          // where torch has no CUDA at all.)
          // The regions are made ready on the stream that reads them: the
          // landing stream where they are copied into torch's memory, else
          // the arrival stream.
          const c10::Stream& arrival = streamOf(device);
          const c10::Stream stream = options_.cudaZeroCopy
              ? arrival
              : local("no CUDA landing stream", [&] {
                  return landingFor(device, peer).stream;
                });
          c10::impl::VirtualGuardImpl impl(c10::kCUDA);
          return reinterpret_cast<uintptr_t>(
              impl.getStreamNativeHandle(stream));
        },
        landing,
        hostLanding,
        !granting_
            ? wire::InboundMessage::AdoptLanded()
            : [&](c10::DeviceIndex device, frame::LandedRegion& region) {
                // Written by the peer into a grant of ours: the message's
                // work waits for the peer's copy, on the arrival stream,
                // which uses the memory.
                const c10::Stream& arrival = streamOf(device);
                c10::impl::VirtualGuardImpl impl(c10::kCUDA);
                local(
                    "waiting for a granted segment on cuda:" +
                        std::to_string(int(device)) + " failed",
                    [&] {
                      region.waitOn(reinterpret_cast<uintptr_t>(
                          impl.getStreamNativeHandle(arrival)));
                    });
                std::unique_ptr<frame::LandedMemory> taken = region.take();
                auto* ours = dynamic_cast<TorchLanded*>(taken.get());
                TORCH_CHECK(ours != nullptr, "granted memory that is not ours");
                c10::DataPtr data = std::move(ours->memory);
                impl.recordDataPtrOnStream(data, arrival);
                granted_.fetch_add(1, std::memory_order_relaxed);
                return data;
              });
    // The channels' regions go now, under the scope (a landed message's
    // copies are queued): a cuda_ipc block's release then rides with our
    // very next frame.
    buffers.regions.clear();
    return message;
  } catch (const wire::LandingFailure& e) {
    // (Only this: what else the codec throws is the peer's doing.)
    failures_.fetch_add(1, std::memory_order_relaxed);
    throw ReceiveFailure(e.what());
  }
}

} // namespace torch_rpc_ext
