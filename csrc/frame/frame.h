// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "csrc/common/option_defaults.h"

namespace torch_rpc_ext::frame {

// Every transport carries the same frames (docs/wire-format.md):
//
//   FrameHeader (24 bytes, little-endian)
//   uint64 segmentLength[numSegments]
//   head   (headLength bytes: small, parsed by the layer above)
//   segment 0 .. numSegments-1 (bulk bytes, read straight into buffers the
//                               layer above chooses after seeing the head)
//
// The receiver checks every length against FrameLimits before it allocates
// anything, so a peer cannot make it allocate more than maxFrameBytes.
constexpr uint32_t kFrameMagic = 0x58505254; // "TRPX"
// 2: channel frame kinds from 16 up, handed out by the channel registry.
// 3: each tensor's device in the message head (wire/codec.h).
// 4: on a TLS connection the handshake's proofs cover the TLS session's
//    exporter value (transport/handshake.h).
// 5: the client proves first; the server's proof follows in a kProof of
//    its own (transport/handshake.h).
// 6: frame rings on shm connections (kFrameRing).
// 7: the shm_ring and cuda_ring channels' wake-ups are Unix stream socket
//    ends, not eventfds (common/signal_socket.h).
// 8: a Python UDF's pickle names its tensors' receiver in
//    torch_rpc_ext._rpc_pickle, which a build before it lacks.
// 9: that pickle names the receiver, and a call's constructor, by copyreg
//    extension codes (torch_rpc_ext/_rpc_pickle.py) a build before it has
//    not registered.
// 10: code 0x54525001 is the receiver object, memoized in each pickle and
//    called per tensor; in 9 it was a function taking the index.
// 11: cuda_ipc's grants (control kinds 4 and 5 of its range, record kind
//    kGranted): a build before them closes a connection that sends one.
// 12: grants end in a revoke and a return too (cuda_ipc control kinds 6
//    and 7), and two may be out per device, each in a slot (a field of
//    the grant and grant-event heads, now 172 and 72 bytes).
// 13: cuda_ipc's kind 35 may carry a reason, sent unasked (the importer
//    could not map the block).
// 14: a lane's listener answers a hello it took with one byte (lanes/lane.h
//    kAdmitted), which the dialler waits for before striping onto it.
constexpr uint8_t kProtocolVersion = 15;

enum class FrameKind : uint8_t {
  kHello = 1, // client -> server: version, identity, nonce
  kChallenge = 2, // server -> client: identity, nonce
  kProof = 3, // client -> server: client proof; then server -> client
  kMessage = 4, // an rpc::Message (request or response), see wire/codec.h
  kPing = 5, // liveness probe; answered with kPong
  kPong = 6,
  // The sender's frames go through shared memory from here on (a connection
  // that passes descriptors: shm): uint64 capacity + the ring's memfd and
  // the receiver's end of its signal socket pair
  // (transport/stream/frame_ring.h).
  kFrameRing = 7,
  // Kinds 8 to 15 are reserved (rejected). Kinds 16 and up belong to the
  // channels: the registry gives the channel at position i of its list
  // (channel/registry.cpp) the kFrameKindsPerChannel kinds from
  // kFirstChannelFrameKind + i * kFrameKindsPerChannel, and a connection
  // rejects the kinds of channels it did not negotiate.
};
constexpr uint8_t kFirstChannelFrameKind = 16;
constexpr uint8_t kFrameKindsPerChannel = 8;
// The most channels the frame kinds leave room for.
constexpr int kMaxChannels =
    (256 - kFirstChannelFrameKind) / kFrameKindsPerChannel;

// Record segments. A segment's bytes need not travel in the stream: a
// channel (csrc/channel/channel.h) may carry them out of band and put
// 16-byte SegmentRecords in the stream in their place. The top byte of the
// segment's announced length names that channel (0: the stream carries the
// bytes; the other bits stay the true length):
//  - a chunk channel sends one record per chunk of the bytes (shm_ring:
//    the sender's ring); a frame with such segments has
//    kFlagChunkedSegments;
//  - a region channel names shared memory holding the whole segment with
//    one record (shm_slab: a slab), and the receiver's buffer becomes a view
//    of it (InboundBuffers::provided).
// A receiver rejects a frame naming a channel its connection did not
// negotiate.
constexpr uint16_t kFlagChunkedSegments = 1;
// Frames through a frame ring (docs/wire-format.md, "Frame rings"): a
// message whose segments' bytes follow on the connection's socket, not in
// the ring (a large body: the socket's buffer takes megabytes a hand-off
// where the ring takes its capacity), and a frame whose descriptors rode a
// carrier on the socket. Neither is valid on a connection without a ring.
constexpr uint16_t kFlagBodyOnSocket = 2;
constexpr uint16_t kFlagCarrier = 4;
constexpr int kChannelIdShift = 56;
constexpr uint64_t kSegmentLengthMask = (uint64_t(1) << kChannelIdShift) - 1;

// What travels in the stream in place of (part of) a record segment; its
// meaning belongs to the transport.
struct SegmentRecord {
  uint64_t a;
  uint64_t b;
};
static_assert(sizeof(SegmentRecord) == 16, "SegmentRecord is 16 bytes");

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t kind;
  uint16_t flags; // zero, or one of the kFlag* above
  uint32_t headLength;
  uint32_t numSegments;
  uint64_t dataLength; // sum of segment lengths
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 24, "FrameHeader layout is fixed");

struct FrameLimits {
  // Largest frame (header, lengths, head and segments) accepted or sent.
  uint64_t maxFrameBytes = kDefaultMaxFrameBytes; // common/option_defaults.h
  uint32_t maxHeadBytes = 1u << 24; // 16 MiB
  uint32_t maxSegments = 1u << 16;
};

// Returns an empty string if `h` is acceptable under `limits`, else a reason
// naming the offending field.
std::string validateHeader(const FrameHeader& h, const FrameLimits& limits);

// Memory a transport hands to the receiver in place of filling a buffer (a
// view of a shared slab): valid while the region object lives. Destroying it
// tells the transport the memory is no longer used, from any thread.
class SharedRegion {
 public:
  virtual ~SharedRegion() = default;
};

// Provided memory on a device (what a device channel lends): the bytes are
// in place once the channel's event completes, which the receiver orders its
// work after with waitOn(), never waiting on the host.
class DeviceRegion : public SharedRegion {
 public:
  // The device index, in this process, of the memory.
  virtual int device() const = 0;
  // Work queued on `stream` (a CUstream, as an integer, of device()) after
  // this call runs once the bytes are in place. The region's memory is then
  // in use on `stream`: when the region dies, the memory goes back to its
  // owner only once the work queued on `stream` by then has finished.
  virtual void waitOn(uintptr_t stream) = 0;
  // The memory is read on `stream` too (a received tensor sent on by a
  // copy on that stream): it goes back only after that read, as after the
  // work of the streams waitOn() was given.
  virtual void recordUse(uintptr_t stream) {}
};

// In place of a region, for a segment whose bytes were read (the stream
// stays in step) but could not be put where the receiver's tensor needs
// them for a reason of the receiver's own (a device channel out of device
// or pinned memory): the message cannot be built, and its call fails with
// `why` (wire::InboundMessage::finish throws wire::LandingFailure).
class FailedRegion final : public SharedRegion {
 public:
  explicit FailedRegion(std::string why) : why_(std::move(why)) {}
  const std::string& why() const {
    return why_;
  }

 private:
  const std::string why_;
};

// A strided view of device memory, sizes and strides in elements (none
// negative), as torch has them.
struct StridedView {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  uint64_t elementSize = 1;
};

// An outbound frame: a head and segments that point into memory kept alive by
// `keepAlive` until the transport has written the frame (or dropped it).
struct OutboundFrame {
  FrameKind kind = FrameKind::kMessage;
  std::string head;
  struct Segment {
    const void* data;
    size_t size;
    // Set when the bytes lie in a region this process received: the
    // transport that provided it may hand the region back instead of
    // copying, but only if `exclusive` (nothing but this frame can reach
    // the memory any more).
    std::shared_ptr<SharedRegion> origin = nullptr;
    bool exclusive = false;
    // Where the bytes live (channel::DeviceKind, c10::DeviceType's values):
    // only channels of this device may carry them.
    uint8_t device = 0;
    // Device memory only: the device's index in this process, and the
    // stream (a CUstream, as an integer) on which the bytes are ready. A
    // channel orders its copy after that stream's work and never waits for
    // it on the host.
    int16_t deviceIndex = -1;
    uintptr_t stream = 0;
    // Device memory only: the device, in the peer's process, the bytes go
    // to (after the device map), or -1 (not said).
    int16_t peerDevice = -1;
    // Device memory only, if set: `data` is the first element of this
    // view, whose elements travel packed in row-major order (`size` bytes);
    // a device channel packs them as it copies (never the whole span).
    std::shared_ptr<const StridedView> view = nullptr;
  };
  std::vector<Segment> segments;
  std::shared_ptr<void> keepAlive;
  // Run, off the transport's loop (where keepAlive is released), when the
  // transport drops the frame queued and not written whole (its connection
  // closed): the peer never had it. Never run once the frame is written, or
  // if the transport refuses it outright (its send returns that). Destroyed
  // where the frame is: it must hold nothing whose last reference may not
  // go on a loop thread (what keepAlive also holds is fine).
  std::function<void()> ifUnsent;
  // Bytes on the wire, once encoded.
  uint64_t wireSize() const;
};

// InboundBuffers::devices: a device the receiver does not serve.
constexpr int8_t kDeviceNotServed = -2;

// Where an inbound frame's segments go. Chosen by the receiver once the head
// is known; `keepAlive` owns the memory. For a segment the transport provides
// itself (onFrameHead's `provided`), the receiver's pointer is unused and the
// transport fills `regions` and `provided` instead.
struct InboundBuffers {
  std::vector<void*> segments; // one per announced segment
  std::shared_ptr<void> keepAlive;
  // Per segment, the CUDA device (in this process) its tensors go to, or -1
  // (host memory, or not said): where a staging channel lands device bytes
  // that travel in the stream. Empty: none said. kDeviceNotServed: a device
  // this process does not serve (the peer broke its device map): the
  // message fails, and a staging channel drops the bytes, touching no
  // device.
  std::vector<int8_t> devices;
  // Filled by the transport: per segment, the provided memory (or null).
  std::vector<void*> provided;
  std::vector<std::shared_ptr<SharedRegion>> regions;
};

} // namespace torch_rpc_ext::frame
