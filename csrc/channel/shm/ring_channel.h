// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/channel/shm/ring.h"
#include "csrc/channel/shm/slab.h"

namespace torch_rpc_ext::channel::shm {

// Its control frames, as offsets into the kinds the registry gave the
// channel (WireIds::kind): docs/wire-format.md.
enum RingFrame : uint8_t {
  kRingSetup = 0, // a new ring: uint64 capacity + memfd and wake-up socket
  kRingDrop = 1, // the sender drops its ring (empty head)
};

// shm_ring: segments of 64 KiB or more in chunks through a shared ring
// (ring.h), one copy per side, both copies running in parallel on two cores.
// Second choice after shm_slab, which declines a segment when its slabs are
// at their bounds.
//
// Memory is paid for by use, so a host full of workers (N x (N-1)
// connections) stays small: a connection maps nothing on connect. Its ring
// is created at kInitialRingBytes for a large segment offered within
// kWarmWithinMs of another one (slab.h: a one-off goes on), replaced by
// one up to 4x larger (to kLargestRingBytes) at the start of a frame when the
// last one filled up, and dropped (kRingDrop; the peer unmaps it too) after
// kIdleRingMs without use.
//
// Frames: kRingSetup (head: uint64 capacity; descriptors: the ring's memfd and
// the consumer's end of its wake-up socket pair) and kRingDrop (empty).
class RingChannel final : public Channel,
                          public std::enable_shared_from_this<RingChannel> {
 public:
  static constexpr uint64_t kInitialRingBytes = 256 * 1024;
  static constexpr uint64_t kLargestRingBytes = 8 * 1024 * 1024;
  static constexpr int64_t kIdleRingMs = 2000;

  RingChannel(
      std::shared_ptr<const Context> context,
      std::weak_ptr<Host> host,
      RingCounters& counters);

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

  bool acceptsRecords() const override {
    return ringIn_.valid();
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
  // Make the first ring (false if none can be made).
  bool makeFirstRing();
  // The kRingSetup frame handing `ring` to the peer (mutex_ held); has the loop
  // watch its wake-up socket.
  ControlFrame setupFrame(const std::shared_ptr<Ring>& ring);
  // The peer released ring space we wait for (loop thread).
  void onWakeFromLoop();
  // Loop thread: watch `ring`'s wake-up socket instead of the last one's.
  void watchFromLoop(const std::shared_ptr<Ring>& ring);
  // Any thread: have the loop stop watching `ring` and let it go.
  void retire(std::shared_ptr<Ring> ring);

  std::weak_ptr<Host> host_;
  RingCounters& counters_;
  OfferClock offers_; // of large segments (kWarmWithinMs)

  std::mutex mutex_; // guards the four below
  std::shared_ptr<Ring> out_; // ours
  std::chrono::steady_clock::time_point used_; // last written to
  bool filled_ = false; // it filled up since it was made
  bool announce_ = false; // made by makeFirstRing(), not yet sent

  std::shared_ptr<Ring> watched_; // loop thread: its wake-up socket is watched
  Ring ringIn_; // the peer's, read on the loop thread
};

} // namespace torch_rpc_ext::channel::shm
