// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/channel/lending.h"
#include "csrc/channel/shm/slab.h"

namespace torch_rpc_ext::channel::shm {

// Its control frames, as offsets into the kinds the registry gave the
// channel (WireIds::kind): docs/wire-format.md.
// docs/wire-format.md. The lending channels' three frames (lending.h).
enum SlabFrame : uint8_t {
  kSlabSetup = kLendSetup, // {uint32 id, uint64 capacity} + its memfd
  kSlabRelease = kLendRelease, // uint32 ids the receiver no longer views
  kSlabDrop = kLendDrop, // uint32 id: the sender unmaps an idle slab
};

// shm_slab: segments of 64 KiB or more through shared slabs (slab.h) as
// regions: one copy on the sender's side, none on the receiver's, and none
// at all for a storage handed back to the peer it came from. When the
// connection's slabs are at their bounds, it declines the segment and the
// next channel (shm_ring) takes it. Slabs are pooled and unmapped after
// kSlabIdleMs free, and a new one is made only for a connection that offered
// another large segment within kWarmWithinMs (a one-off goes on).
//
// Frames: kSlabSetup (head: uint32 id, uint64 capacity; descriptor: the memfd),
// kSlabRelease (uint32 ids) and kSlabDrop (uint32 id).
class SlabChannel final : public Channel,
                          public std::enable_shared_from_this<SlabChannel> {
 public:
  SlabChannel(
      std::shared_ptr<const Context> context,
      std::weak_ptr<Host> host,
      SlabCounters& counters);

  bool takeRegion(
      const frame::OutboundFrame::Segment& segment,
      frame::SegmentRecord* record,
      std::vector<ControlFrame>* before) override;
  void abandonRegion(
      const frame::OutboundFrame::Segment& segment,
      const frame::SegmentRecord& record) override;
  void collectPendingLocked(std::vector<ControlFrame>* out) override;

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
    return 1; // a kSlabSetup frame's memfd
  }
  void onTickFromLoop() override;
  void onClosedFromLoop() override;

  // From a SlabLease's destructor, any thread: we no longer use the peer's
  // slab `id` (tell the peer), or our own slab `id` came back from the peer
  // and is free again.
  void releasePeerSlab(uint32_t id, uint64_t capacity);
  void freeOwnSlab(uint32_t id);

 private:
  bool onSetupFromLoop(
      Host& host,
      const std::string& head,
      std::vector<int>& fds);
  bool onReleaseFromLoop(Host& host, const std::string& head);
  bool onDropFromLoop(Host& host, const std::string& head);
  // Unmap free slabs idle for kSlabIdleMs, telling the peer to unmap them
  // too.
  void trim();
  // Send the pending releases now.
  void flushReleases();
  // The kSlabRelease frame of every pending release (releaseMutex_).
  ControlFrame takeReleasesLocked();

  std::weak_ptr<Host> host_;
  SlabCounters& counters_;
  OfferClock offers_; // of large segments (kWarmWithinMs)

  // The peer's slabs we have mapped, by id (loop thread).
  std::unordered_map<uint32_t, std::shared_ptr<Slab>> peerSlabs_;
  uint64_t peerSlabBytes_ = 0;

  // Our slabs, by id. kFree: in our pool; kLent: the peer's tensors use it;
  // kLocal: handed back by the peer, our tensors use it.
  struct OwnSlab {
    enum class State { kFree, kLent, kLocal };
    std::shared_ptr<Slab> slab;
    State state = State::kFree;
    std::chrono::steady_clock::time_point lastUsed;
  };
  std::mutex slabMutex_; // guards the members below; never held while
                         // copying or taking another lock
  std::unordered_map<uint32_t, OwnSlab> ownSlabs_;
  uint32_t nextSlabId_ = 1;
  size_t slabsBeingMapped_ = 0; // ids taken, not yet in ownSlabs_
  bool closed_ = false; // onClosedFromLoop ran: no slab is entered after
  // Every slab of ours the peer knows of (free, lent or handed back), and
  // those being made: what it has mapped, as it counts it. (Until session
  // 93 only lent slabs counted here: free ones, kept 2 s, could take the
  // peer's count past its bound, which closed the connection.)
  uint64_t ownSlabBytes_ = 0;

  // Releases of the peer's small slabs not yet sent: they ride with our next
  // frame, or go alone on the tick.
  std::mutex releaseMutex_;
  std::string pendingReleases_; // uint32 ids
};

} // namespace torch_rpc_ext::channel::shm
