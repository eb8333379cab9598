// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/channel/shm/slab.h"
#include "csrc/common/signal_socket.h"

namespace torch_rpc_ext::channel::cuda {

// cuda_ring: CUDA tensors between two processes of one host that cuda_ipc
// cannot join (devices that do not see each other and have no peer access,
// no interprocess events, cuda_ipc's memory bound reached), through a ring
// of pinned host memory both processes share (docs/cuda.md, "The cuda_ring
// channel"). What cuda_staged does through the socket, without the socket:
// no CPU touches the bytes.
//
// The sender owns the ring: a sealed memfd of kRingSlots slots of
// kRingSlotBytes, registered with the driver (cuMemHostRegister) in both
// processes, and a wake-up socket pair. At the send the tensor is copied on
// the caller's stream into a device block of the pool (its value at the send
// travels; a strided view is packed); once that copy has completed (an
// event the staging thread polls) the segment goes in chunks of one slot:
// the sender copies chunk k out of the block into a free slot, and when
// that copy has completed puts a SlotRecord naming the slot in the stream,
// while the next chunks are still copying. The receiver copies the slot onto
// its device (the block its tensor will view, as cuda_staged's) and, once
// that copy has completed, releases the slot: it raises the slot's counter
// in the ring's header and wakes the sender through the socket. Copies out
// of one device, hand-off and copies onto the other overlap chunk by chunk.
//
// Releases travel through the shared header, not in frames: a frame waiting
// for a slot must not hold up the releases of the other direction's ring
// (each end's writes would wait for the other's).
//
// Memory is paid for by use: a connection makes its ring for its first
// segment of kRingMinSegment or more, and drops it (kRingDrop) after
// kRingIdleMs unused. Segments below that are left to cuda_staged (which
// gathers them into one copy).

constexpr uint32_t kRingSlots = 8;
constexpr uint64_t kRingSlotBytes = uint64_t(4) << 20;
constexpr uint64_t kRingMinSegment = uint64_t(1) << 20;
constexpr int64_t kRingIdleMs = 5000;
// How long an idle ring stays: kRingIdleMs, or
// $TORCH_RPC_EXT_CUDA_RING_IDLE_MS (0 to 600000) where the context's probe
// read it.
int64_t ringIdleMs();
// The header before the slots: a release counter per slot, a cache line
// each.
constexpr uint64_t kRingHeaderBytes = 4096;
constexpr uint64_t kRingCounterStride = 64;
constexpr uint32_t kMaxRingSlots = kRingHeaderBytes / kRingCounterStride;
constexpr uint64_t kMaxRingSlotBytes = uint64_t(64) << 20;
// The most a peer's ring may be (what the receiver maps and pins for it).
constexpr uint64_t kMaxRingBytes = uint64_t(256) << 20;

// Its control frames (WireIds::kind offsets; docs/wire-format.md).
enum RingFrame : uint8_t {
  // A new ring: RingSetup as head; descriptors: the memfd and the
  // receiver's end of the wake-up socket pair.
  kRingSetup = 0,
  kRingDrop = 1, // head: the ring's uint64 generation
};

#pragma pack(push, 1)
struct RingSetup {
  uint64_t generation;
  uint32_t slots;
  uint32_t reserved; // zero
  uint64_t slotBytes;
};
#pragma pack(pop)
static_assert(sizeof(RingSetup) == 24, "RingSetup is 24 bytes on the wire");

// What travels in the stream in place of a chunk.
struct SlotRecord {
  uint64_t generation; // of the ring that holds it
  uint32_t slot;
  uint32_t bytes;
};
static_assert(sizeof(SlotRecord) == 16, "SlotRecord is 16 bytes on the wire");

struct SlotRingCounters {
  std::atomic<uint64_t> sent{0}; // segments
  std::atomic<uint64_t> sentBytes{0};
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> receivedBytes{0};
  std::atomic<uint64_t> chunks{0}; // chunks copied either way
  std::atomic<uint64_t> created{0}; // rings made
  std::atomic<uint64_t> dropped{0}; // rings dropped when idle
  // Segments this process could not take or land (no ring could be made;
  // no device memory to land in: that message's call failed).
  std::atomic<uint64_t> declined{0};
  std::atomic<uint64_t> slotWaits{0}; // a chunk waited for a free slot
};

// One direction's ring, mapped in this process: the slots, their release
// counters, the wake-up socket pair, and the registration that makes the slots
// pinned memory for the driver. The last holder unregisters and unmaps it
// (copies still using it hold it too).
class RingMemory {
 public:
  // A new ring (sender). Throws naming the failing call.
  static std::shared_ptr<RingMemory> create(
      uint64_t generation,
      uint32_t slots,
      uint64_t slotBytes);
  // The peer's ring from its setup frame (receiver; owns both descriptors
  // from the call on: kept by the ring, or closed on failure). Returns an
  // error text, or "".
  static std::string attach(
      const RingSetup& setup,
      int memFd,
      int wakeFd,
      std::shared_ptr<RingMemory>* out);
  ~RingMemory();

  uint64_t generation() const {
    return generation_;
  }
  uint32_t slots() const {
    return slots_;
  }
  uint64_t slotBytes() const {
    return slotBytes_;
  }
  char* slot(uint32_t i) const;
  int memFd() const;
  // This side's end of the wake-up socket pair (signal_socket.h): the
  // sender watches it, the receiver signals on it.
  int wakeFd() const {
    return wakeFd_;
  }
  // Sender: the receiver's end, handed over in the setup frame and kept
  // open with the ring, so our watched end does not read as ended when the
  // receiver closes it (shutting it down does: drainWakeups()).
  int peerWakeFd() const {
    return peerWakeFd_;
  }
  // The count of releases of slot `i` (the receiver raises it).
  uint64_t released(uint32_t i) const;
  // Receiver, any thread: slot `i` may be written again; wakes the sender.
  void release(uint32_t i);
  // Sender, loop thread: reads the wake-ups the receiver's releases left.
  // Anything but kOpen once the receiver has shut the wake-up down or
  // passed descriptors over it (stop watching it).
  SignalDrain drainWakeups();
  // Registers the slots with the driver, once, in `device`'s context
  // (portable: every context of the process sees them pinned). Throws
  // naming the failing call (and tries again on the next call).
  void pin(int device);

 private:
  RingMemory() = default;
  std::shared_ptr<shm::Slab> file_;
  int wakeFd_ = -1;
  int peerWakeFd_ = -1; // sender only
  uint64_t generation_ = 0;
  uint32_t slots_ = 0;
  uint64_t slotBytes_ = 0;
  std::mutex pinMu_;
  int pinnedDevice_ = -1;
  std::string pinError_; // the registration failed once: why
};

// Records `event` on `stream` after a copy into or out of `ring` queued
// there; where the record fails (it throws), `ring` is kept until the
// stream has drained, since no completion of the copy will hold it.
void recordOrHold(
    int device,
    const std::shared_ptr<CUevent_st>& event,
    CUstream stream,
    std::shared_ptr<RingMemory> ring);

class RingOut;

class RingChannel final : public Channel,
                          public std::enable_shared_from_this<RingChannel> {
 public:
  RingChannel(
      std::shared_ptr<const Context> context,
      std::weak_ptr<Host> host,
      SlotRingCounters& counters);
  ~RingChannel() override;

  // ---- Sender (cuda_ring_sender.cpp)
  // -------------------------------------------
  bool takeChunks(
      const frame::OutboundFrame::Segment& segment,
      std::shared_ptr<StagedOut>* staged) override;
  std::optional<ControlFrame> prepareChunksLocked() override;
  size_t produceChunkLocked(
      const char* data,
      size_t size,
      StagedOut* staged,
      frame::SegmentRecord* record,
      std::string* error) override;
  std::optional<ControlFrame> dropIfIdleLocked() override;

  // ---- Receiver (cuda_ring_channel.cpp)
  // ----------------------------------------
  bool acceptsRecords() const override {
    return ringIn_ != nullptr;
  }
  int64_t onRecordFromLoop(
      const frame::SegmentRecord& record,
      InboundSegment& segment) override;
  bool acceptsControlFrame(frame::FrameKind kind, uint32_t headLength)
      const override;
  bool onControlFrameFromLoop(
      frame::FrameKind kind,
      const std::string& head,
      std::vector<int>& fds) override;
  size_t maxPendingFds() const override {
    return 2; // a kRingSetup frame's memfd and wake-up socket
  }
  void onClosedFromLoop() override;

 private:
  friend class RingOut;
  enum class Slot : uint8_t { kFree, kCopying, kCopied, kSent, kOrphan };

  // Sender, mutex_ held: slots the receiver released become free; copies
  // of `out`'s next chunks start in the free ones.
  void reclaimLocked();
  void startCopiesLocked(RingOut& out);
  // A copy out into `slot` of ring `generation` completed (loop thread).
  void onCopiedFromLoop(uint64_t generation, uint32_t slot);
  // `out` is gone (its frame written or dropped): its chunks not sent give
  // their slots back.
  void forget(RingOut& out);
  void watchFromLoop(const std::shared_ptr<RingMemory>& ring);
  // A copy failed (the staging thread): the connection closes naming it.
  void failFromStagingThread(const std::string& why);
  void retire(std::shared_ptr<RingMemory> ring);
  void wakeWriter();

  struct Landing;
  void abandonLanding();

  std::weak_ptr<Host> host_;
  SlotRingCounters& counters_;

  std::mutex mutex_; // guards the sender's state below
  std::shared_ptr<RingMemory> out_;
  bool announce_ = false; // made, its setup frame not yet sent
  std::chrono::steady_clock::time_point used_;
  uint64_t nextGeneration_ = 1;
  std::vector<Slot> slots_;
  std::vector<uint64_t> sentCount_; // records sent per slot
  size_t outs_ = 0; // segments taken whose frames are not done with

  std::shared_ptr<RingMemory> watched_; // loop thread: its wake-up socket
  std::shared_ptr<RingMemory> ringIn_; // the peer's (loop thread)
  std::unique_ptr<Landing> landing_; // the segment being received
};

// The process's cuda_ring (registry.cpp).
std::shared_ptr<Context> createRingChannel(WireIds ids);

} // namespace torch_rpc_ext::channel::cuda
