// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/distributed/rpc/message.h>

#include "csrc/common/buffer_pool.h"
#include "csrc/frame/frame.h"

namespace torch_rpc_ext::frame {
class LandedRegion;
} // namespace torch_rpc_ext::frame

namespace torch_rpc_ext::wire {

// The distinct tensor storages one message may carry (a segment each): a
// frame's segments (frame::FrameLimits::maxSegments, on both ends) less
// the payload's.
constexpr size_t kMaxStorages = (size_t(1) << 16) - 1;
// The most bytes of tensor metadata (the head) one message may carry:
// frame::FrameLimits::maxHeadBytes, on both ends. A strided tensor's entry
// takes 17 + 16 per dim of it (a view each, of one storage or many).
constexpr size_t kMaxHeadBytes = size_t(1) << 24;

namespace rpc = torch::distributed::rpc;

// rpc::Message <-> transport frame (docs/wire-format.md, "Message frames").
//
// The head carries the message type and id and each tensor's metadata
// (layout, dtype, sizes, strides, offset, which segment holds its bytes).
// Segment 0 is the message payload; every further segment is the used span
// of one tensor storage, sent straight from the storage (nothing is pickled
// or copied). A strided view of 64 KiB of span or more that leaves much of
// it unused is sent compact instead of dragging its whole base along: a CPU
// one past half unused as a contiguous copy, a CUDA one past an eighth as a
// segment of its own that its device channel packs as it copies
// (OutboundFrame::Segment::view); either arrives contiguous.

// How a message's CUDA tensors travel, for an agent with devices: each
// tensor's device is mapped to the peer's, and its bytes are read on the
// stream they are ready on.
struct DeviceRoute {
  // Local device -> the peer's device a tensor on it lands on (an
  // rpc::DeviceMap).
  std::unordered_map<c10::Device, c10::Device> map;
  // The stream (a CUstream, as an integer) a tensor on `device` is ready
  // on: the sender's current stream of that device.
  std::function<uintptr_t(c10::Device)> readyStream;
  // Copies in host memory of the CUDA tensors the map sends to the peer's
  // CPU, made after the work queued on their ready streams (back when it
  // returns): views of one storage stay views of one host copy.
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> toHost;
  // The peer's name, for errors.
  std::string peer;
};

// Bytes from a tensor's first element to one past its last, from its
// storage offset on; 0 for an empty tensor.
int64_t extentBytes(const at::Tensor& t);

// The text of a CUDA tensor that no map sends anywhere: TensorPipe's words
// (upstream's tests match them) after ours.
std::string unmappedDeviceError(
    const c10::Device& device,
    const std::string& peer,
    bool request);

// Encode `message` under `id`. The frame keeps the message (and any compact
// copies) alive. Throws c10::Error for tensors that cannot travel (a CUDA
// tensor without `route` or whose device it does not map, other devices,
// quantized, unsupported layout). Under `route`, a CUDA tensor mapped to
// "cpu" travels as a host copy (route->toHost) and a CPU tensor mapped to a
// CUDA device travels as host bytes that the receiver copies onto it. Does not
// modify `message`, so retries can send it again.
//
// `trace`, if not empty: the caller's trace context (a W3C traceparent, at
// most kMaxTraceContext bytes), carried at the end of the head
// (docs/wire-format.md) for the callee's spans (torch_rpc_ext.tracing).
frame::OutboundFrame encodeMessage(
    const c10::intrusive_ptr<rpc::Message>& message,
    int64_t id,
    const DeviceRoute* route = nullptr,
    const std::string& trace = {});

// The longest trace context a head carries (a traceparent is 55 bytes).
constexpr size_t kMaxTraceContext = 255;
// Whether `s` is a W3C traceparent a callee may use: "00-" + 32 lowercase
// hex digits (not all zero) + "-" + 16 (not all zero) + "-" + 2.
bool isTraceparent(const std::string& s);

// What InboundMessage::finish() throws for a segment its channel could not
// land here (frame::FailedRegion): the receiver's failure, not the peer's.
class LandingFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An inbound message whose head has been validated and whose buffers are
// allocated, waiting for its segments.
class InboundMessage {
 public:
  // Parse and check `head` against `segmentSizes` before allocating anything.
  // Large tensor segments come from `pool` (when given), smaller ones from
  // the CPU allocator; segments marked in `provided` get no buffer: the
  // transport brings their memory (a shared slab), and the tensor's storage
  // becomes a view of it in finish(). Throws std::invalid_argument naming
  // the first problem.
  static std::shared_ptr<InboundMessage> prepare(
      const std::string& head,
      const std::vector<uint64_t>& segmentSizes,
      const std::shared_ptr<BufferPool>& pool = nullptr,
      const std::vector<bool>& provided = {});

  // Where the transport writes each segment.
  frame::InboundBuffers buffers(const std::shared_ptr<InboundMessage>& self);

  // Where CUDA segments' bytes end up: copies of the channel's device
  // memory in memory of torch's CUDA allocator. Given `device`, the stream
  // the regions were made ready on (a CUstream, as an integer) and the
  // spans (address, bytes) of the channel's memory in segment order, it
  // returns allocations and, per span, the allocation and byte offset that
  // hold its bytes for work queued on the arrival stream from now on.
  // Several small spans may share one allocation (their tensors then view
  // one storage at different offsets); an offset is a multiple of 256.
  struct Landed {
    std::vector<c10::DataPtr> allocations;
    std::vector<uint64_t> sizes; // of each allocation, bytes
    std::vector<std::pair<uint32_t, uint64_t>> places; // per span
  };
  using DeviceLanding = std::function<Landed(
      c10::DeviceIndex device,
      uintptr_t stream,
      const std::vector<std::pair<uintptr_t, size_t>>& spans)>;

  // Where the host bytes of CUDA tensors sent from a peer's CPU ({"cpu": d}
  // maps) end up: given `device`, its arrival stream and the host storages
  // in segment order, one allocation of `device` per storage, each holding
  // its bytes for work queued on the stream from now on.
  using HostLanding = std::function<std::vector<c10::DataPtr>(
      c10::DeviceIndex device,
      uintptr_t stream,
      const std::vector<c10::Storage>& hosts)>;

  // Build the message once every segment is in place (`buffers`: what the
  // transport filled in, including provided memory). CUDA tensors are ready
  // for work queued on `arrivalStream(device)` (a CUstream, as an integer)
  // from now on; without it, a CUDA tensor is an error. With `landing` they
  // live in the memory it returns (the channel's goes back at once);
  // without it they view the device memory the channel provided, for as
  // long as they live (zero copy).
  // A segment whose region is already landed memory of torch's
  // (frame::LandedRegion: a grant the sender wrote into) is that memory, as
  // `adoptLanded` returns it (the agent makes the arrival stream wait on the
  // region, and records the memory's use there); without it, an error.
  using AdoptLanded = std::function<
      c10::DataPtr(c10::DeviceIndex device, frame::LandedRegion& region)>;
  c10::intrusive_ptr<rpc::Message> finish(
      const frame::InboundBuffers& buffers = {},
      const std::function<uintptr_t(c10::DeviceIndex)>& arrivalStream = nullptr,
      const DeviceLanding& landing = nullptr,
      const HostLanding& hostLanding = nullptr,
      const AdoptLanded& adoptLanded = nullptr);

  // The payload, where it arrived in memory a channel provided (a slab):
  // copied out once, so that the slab goes back and a message that fails
  // before finish() (its tensors could not land) still has the payload
  // withoutTensors() reads. finish() calls it; so does a caller that may
  // fail the message first. Throws if the payload is in device memory.
  void adoptPayload(const frame::InboundBuffers& buffers);

  // The message with empty CPU tensors in place of its own, for a request
  // whose tensors could not land (its ids are read, nothing runs): its
  // payload must be in place (adoptPayload()).
  c10::intrusive_ptr<rpc::Message> withoutTensors() const;

  // The CUDA devices this message's tensors are on (after prepare()).
  const std::vector<c10::DeviceIndex>& cudaDevices() const {
    return cudaDevices_;
  }

  rpc::MessageType type() const {
    return type_;
  }
  int64_t id() const {
    return id_;
  }
  // Payload and tensor bytes this message carries.
  uint64_t byteSize() const {
    return bytes_;
  }
  // The caller's trace context, if it sent one that is a valid traceparent
  // (else empty; traceIgnored() says one was there and was not).
  const std::string& traceContext() const {
    return trace_;
  }
  bool traceIgnored() const {
    return traceIgnored_;
  }

  struct DenseMeta {
    c10::ScalarType dtype;
    bool requiresGrad;
    c10::SmallVector<int64_t, 4> sizes;
    c10::SmallVector<int64_t, 4> strides;
    int64_t offset;
    uint32_t segment;
    int8_t device; // CUDA device index, or -1: CPU
    bool hostCarried = false; // device >= 0, its bytes sent as host bytes
  };
  struct TensorMeta {
    bool sparse;
    bool quantized;
    // The tensor itself, the values of a sparse one, or the integers of a
    // quantized one.
    DenseMeta dense;
    DenseMeta indices; // sparse only; quantized per channel: the scales
    DenseMeta zeroPoints; // quantized per channel
    c10::SmallVector<int64_t, 4> sparseSizes;
    bool coalesced;
    bool requiresGrad;
    c10::ScalarType qdtype; // quantized: qint8, quint8 or qint32
    c10::QScheme qscheme;
    double scale; // quantized per tensor
    int64_t zeroPoint;
    int64_t axis; // quantized per channel
  };

 private:
  rpc::MessageType type_;
  int64_t id_;
  uint64_t bytes_ = 0;
  std::string trace_;
  bool traceIgnored_ = false;
  std::vector<char> payload_;
  bool payloadAdopted_ = false; // adoptPayload() copied it
  std::vector<uint64_t> sizes_; // of every segment, if any is provided
  std::vector<c10::Storage> storages_; // one per segment after the payload
  // Per segment after the payload, where a landing packed several into one
  // storage: the byte offset of its bytes in it (else empty).
  std::vector<uint64_t> storageOffsets_;
  c10::SmallVector<TensorMeta, 2> tensors_;
  // Per segment after the payload: the CUDA device of its tensors, or -1.
  c10::SmallVector<int8_t, 8> segmentDevices_;
  // Per segment after the payload: the CUDA device its host bytes are
  // copied onto in finish(), or -1.
  c10::SmallVector<int8_t, 8> segmentLandings_;
  std::vector<c10::DeviceIndex> cudaDevices_;
};

} // namespace torch_rpc_ext::wire
