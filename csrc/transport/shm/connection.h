// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "csrc/transport/shm/ring.h"
#include "csrc/transport/shm/slab.h"
#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::shm {

struct SlabCounters;

// An shm connection: the stream core over an abstract Unix socket between
// two processes of one host, plus shared memory for bulk bytes.
//
// Segments of 64 KiB or more go through shared slabs (slab.h) as region
// segments: one copy on the sender's side, none on the receiver's, and none
// at all for a storage handed back to the peer it came from. When the
// connection's slabs are at their bounds, such segments go as chunked
// segments through a ring (ring.h) instead: one copy per side.
//
// Memory is paid for by use, so a host full of workers (N x (N-1)
// connections) stays small: a connection maps nothing on connect. Its ring
// is created on the first chunked segment at kInitialRingBytes, replaced by
// one up to 4x larger (to kLargestRingBytes) at the start of a frame when
// the last one filled up, and dropped (kRingDrop; the peer unmaps it too)
// after kIdleRingMs without use. Slabs are pooled and unmapped after
// kSlabIdleMs free.
//
// Frames beyond the core's: kRing (head: uint64 capacity; descriptors: the
// ring's memfd and its wake-up eventfd), kRingDrop (empty), kSlab, kSlabRelease
// and kSlabDrop (slab.h).
class ShmConnection final : public stream::StreamConnection {
 public:
  static constexpr uint64_t kInitialRingBytes = 256 * 1024;
  static constexpr uint64_t kLargestRingBytes = 8 * 1024 * 1024;
  static constexpr int64_t kIdleRingMs = 2000;

  ShmConnection(
      stream::Loop& loop,
      const TransportOptions& options,
      SlabCounters& counters,
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer);

  // The peer released ring space we wait for. Loop thread.
  void onRingWakeFromLoop();

  // Slabs (connection_slabs.cpp), from a SlabLease's destructor on any
  // thread: we no longer use the peer's slab `id` (tell the peer), or our
  // own slab `id` came back from the peer and is free again.
  void releasePeerSlab(uint32_t id, uint64_t capacity);
  void freeOwnSlab(uint32_t id);

 protected:
  size_t maxPendingFds() const override;
  bool acceptsControlFrame(FrameKind kind, uint32_t headLength) const override;
  bool onControlFrameFromLoop(FrameKind kind) override;
  bool acceptsRecordSegments(uint64_t bit) const override;
  int64_t onSegmentRecordFromLoop(uint64_t bit, const SegmentRecord& record)
      override;
  void planFrameSegments(
      OutboundFrame& frame,
      PendingWrite& w,
      std::vector<bool>& region,
      std::vector<PendingWrite>& before) override;
  std::optional<PendingWrite> prepareChunkChannelLocked() override;
  size_t produceChunkLocked(
      const char* data,
      size_t size,
      SegmentRecord* record,
      std::string* error) override;
  void queueBeforeMessageLocked() override;
  void onTickFromLoop() override;
  void onClosedFromLoop() override;

 private:
  // Rings (connection_ring.cpp).
  bool onRingSetupFromLoop();
  bool onRingDropFromLoop();
  // Drop our ring if it has been idle for kIdleRingMs (loop thread).
  void dropIdleRingFromLoop();
  // Loop thread: watch `ring`'s wake-up eventfd instead of the last one's.
  void watchRingFromLoop(const std::shared_ptr<Ring>& ring);
  // Any thread: have the loop stop watching `ring` and let it go.
  void retireRing(std::shared_ptr<Ring> ring);

  // Slabs (connection_slabs.cpp).
  // Writer, without writeMutex_: send `segment` through a slab if it is
  // large enough and the bounds allow. Fills `record`, and `setup` with a
  // new slab the peer must be handed first. False: send it another way.
  bool prepareSlabSegment(
      const OutboundFrame::Segment& segment,
      SlabRecord* record,
      std::shared_ptr<Slab>* setup);
  // The kSlab frame handing `slab` (our slab `id`) to the peer.
  PendingWrite slabSetupFrame(uint32_t id, std::shared_ptr<Slab> slab);
  bool onSlabSetupFromLoop();
  bool onSlabReleaseFromLoop();
  bool onSlabDropFromLoop();
  int64_t onSlabRecordFromLoop(const SlabRecord& r);
  // Unmap free slabs idle for kSlabIdleMs, telling the peer to unmap them
  // too.
  void trimSlabs();
  // Queue one kSlabRelease frame for every pending release (writeMutex_).
  void queueReleasesLocked();
  void flushReleases();

  SlabCounters& counters_;

  // Our ring (writeMutex_), when it was last written to, and whether it
  // filled up since it was made.
  std::shared_ptr<Ring> ringOut_;
  std::chrono::steady_clock::time_point ringUsed_;
  bool ringFilled_ = false;
  std::shared_ptr<Ring> ringWatched_; // loop thread: its eventfd is watched
  Ring ringIn_; // the peer's, read on the loop thread

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
  uint64_t lentSlabBytes_ = 0;
  // Releases of the peer's small slabs not yet sent (writeMutex_): they ride
  // with our next frame, or go alone on the tick.
  std::string pendingReleases_; // uint32 ids
};

} // namespace torch_rpc_ext::transport::shm
