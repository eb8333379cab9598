// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The agent's CUDA side (docs/cuda.md, "The agent's CUDA path"): its
// devices and maps, the streams tensors arrive on, the copy of received
// CUDA segments into torch's caching allocator, and how tensors leave.
//
// Threads: every member may be called from any thread (the caller's in
// send(), loop threads as frames arrive, pool threads serving requests).
// The state is the options (const), the landing counters (atomic) and the
// landing streams (landingMu_).

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/rpc/message.h>
#include <torch/csrc/distributed/rpc/types.h>

#include "csrc/agent/options.h"
#include "csrc/wire/codec.h"

namespace torch_rpc_ext {

namespace rpc = torch::distributed::rpc;

// A message that arrived whole and well formed but could not be received
// here: device memory exhausted or refused, torch's CUDA state missing, a
// device this worker does not have. Our side's failure, not the peer's: the
// agent fails that one call (on both ends) and keeps the connection.
class ReceiveFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Received CUDA segments up to this size share torch allocations of up to
// kLandPackBytes (AgentDevices::land).
constexpr uint64_t kLandPackMaxSegment = uint64_t(1) << 20;
constexpr uint64_t kLandPackBytes = uint64_t(4) << 20;
// Landing streams per device (AgentDevices::landingFor).
constexpr int kLandingSlots = 8;

class AgentDevices {
 public:
  // `self`: our worker name, for errors.
  AgentDevices(const AgentOptions& options, std::string self)
      : options_(options),
        self_(std::move(self)),
        granting_(!options.landingPools.empty()) {}

  const std::vector<c10::Device>& devices() const {
    return options_.devices;
  }
  // The options' map to worker `name` (empty if none).
  rpc::DeviceMap mapTo(const std::string& name) const;
  // How CUDA tensors to worker `peer` travel under `map`.
  wire::DeviceRoute routeTo(const std::string& peer, const rpc::DeviceMap& map)
      const;
  // Whether a message to a peer needs a route (wire::DeviceRoute): our
  // devices, a map to it, or a CUDA tensor to refuse naming the peer.
  static bool needsRoute(
      const std::vector<c10::Device>& devices,
      const rpc::DeviceMap& map,
      const rpc::Message& message) {
    if (!devices.empty() || !map.empty()) {
      return true;
    }
    for (const auto& t : message.tensors()) {
      if (!t.device().is_cpu()) {
        return true;
      }
    }
    return false;
  }
  // Tell the caching allocator that `message`'s CUDA storages are read on
  // the current streams of their devices (by the channels' copies).
  static void recordCudaUse(const rpc::Message& message);

  // At init_rpc, on the caller's thread, for an agent with devices: makes
  // sure torch's CUDA state exists (its caching allocator has no tables for
  // a device before torch's lazy CUDA init, which a worker that never used
  // CUDA itself has not run), then warms what the first message would pay
  // for on a transport loop: each device's context, torch's stream pool
  // and the copy engine's kernels. Logs, and does not throw, where that
  // fails: the first CUDA message then fails its call naming the cause.
  void prepare() const;

  // A stream from the pool for each of our devices, for an arriving message
  // (empty without devices).
  std::vector<c10::Stream> arrivalStreams() const;
  // Turn a received frame into its message: CUDA tensors are ready on
  // `streams` (filled with arrivalStreams() if the message has any) and,
  // unless cuda_zero_copy, copied on them into torch's allocator (land()).
  // Throws what the wire codec throws (the peer broke the protocol), or
  // ReceiveFailure (landing failed here: no such device of ours, device
  // memory, torch's CUDA state).
  // `peer`: the sender's worker id (which landing stream its messages use).
  c10::intrusive_ptr<rpc::Message> finish(
      wire::InboundMessage& in,
      frame::InboundBuffers& buffers,
      std::vector<c10::Stream>& streams,
      int32_t peer);

  // A device of the message's that we do not serve, or -1. init_rpc's check
  // of every device map makes one a broken promise of the peer's: its
  // segments are marked frame::kDeviceNotServed in `buffers` (onFrameHead),
  // so that no channel makes a context or staging memory on that device,
  // and finish() fails the message naming it.
  int unserved(const wire::InboundMessage& in) const;
  void markUnserved(const wire::InboundMessage& in, frame::InboundBuffers& b)
      const;
  // Whether cuda:d is among the `devices` of our options.
  bool serves(int d) const;

  // The CUDA channels' own device memory (channel/cuda/device_memory.h):
  // bounded by cuda_ipc_memory_limit, and out of memory once, torch's
  // caching allocator frees its cache before they try again. Process-wide.
  void useTorchForChannelMemory() const;

  // rpc_ext.cuda.* (get_metrics).
  void addMetrics(std::unordered_map<std::string, std::string>& m) const;

 private:
  // A message's CUDA segments of one device (the channel's memory), copied
  // on its arrival `stream` into memory of torch's CUDA allocator allocated
  // on that stream (wire::InboundMessage::DeviceLanding), so that received
  // tensors follow torch's stream rules: record_stream and a future's
  // wait() on another stream keep the memory from reuse until that
  // stream's work is done.
  //
  // The copies run on a landing stream of the device (landingFor()), where
  // the memory is allocated too, so torch's cache serves every landing after
  // the first messages; the arrival stream waits for them on one event.
  // Segments up to kLandPackMaxSegment share allocations of up to
  // kLandPackBytes: one allocation for a message of many small tensors,
  // whose storages are then one (each tensor a view at its own offset).
  struct Landing {
    Landing(int s, c10::Stream st) : slot(s), stream(st), copied(c10::kCUDA) {}
    const int slot;
    const c10::Stream stream;
    std::mutex mu; // record + block of `copied`
    c10::Event copied; // recorded after each landing's copies
  };
  wire::InboundMessage::Landed land(
      Landing& landing,
      const c10::Stream& arrival,
      const std::vector<std::pair<uintptr_t, size_t>>& spans);
  // The landing stream of `device` for messages from worker `peer`: one of
  // kLandingSlots per device (peers share them by id), so a peer whose
  // tensors are late (its `ready` recorded behind long work) holds back the
  // landings of the few peers of its slot, not every peer's; made once.
  Landing& landingFor(c10::DeviceIndex device, int32_t peer) const;
  // The same for host storages ({"cpu": d} maps): each copied onto the
  // device on `stream`, and held until the copy has read it.
  std::vector<c10::DataPtr> landFromHost(
      const c10::Stream& stream,
      const std::vector<c10::Storage>& hosts);
  // Host copies of CUDA tensors ({d: "cpu"} maps), made on the current
  // streams of their devices after the work queued there: the span of each
  // storage they use copied once, each tensor a view of its storage's copy.
  static std::vector<at::Tensor> toHost(const std::vector<at::Tensor>& ts);
  // Runs `fn`, turning what it throws into a ReceiveFailure saying `what`.
  template <typename Fn>
  auto local(const std::string& what, Fn&& fn) -> decltype(fn());

  const AgentOptions& options_;
  const std::string self_;
  // CUDA segments copied into torch's allocator on arrival, and their bytes.
  std::atomic<uint64_t> landings_{0}; // launches (one per device)
  std::atomic<uint64_t> landed_{0};
  std::atomic<uint64_t> landedBytes_{0};
  std::atomic<uint64_t> landedAllocations_{0};
  // Whether we grant landing memory (a landing pool per device): a peer's
  // segment may then arrive written into it.
  const bool granting_;
  // Segments the peer wrote straight into landing memory we granted.
  std::atomic<uint64_t> granted_{0};
  mutable std::mutex landingMu_;
  mutable std::vector<std::unique_ptr<Landing>> landingStreams_;
  std::atomic<uint64_t> fromHost_{0}; // segments landed from host bytes
  mutable std::atomic<uint64_t> toHost_{0}; // CUDA tensors sent as host copies
  std::atomic<uint64_t> failures_{0}; // messages that could not land
};

} // namespace torch_rpc_ext
