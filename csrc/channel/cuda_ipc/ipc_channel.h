// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/channel/cuda/copy_engine.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/channel/cuda_ipc/block.h"
#include "csrc/channel/grants.h"
#include "csrc/channel/lending.h"

namespace torch_rpc_ext::channel::cuda {

class BlockLease;

// cuda_ipc: CUDA tensors between two processes of one host, as shm_slab
// moves CPU ones (docs/cuda.md, "The cuda_ipc channel").
//
// The sender copies a segment, on the stream the bytes are ready on, into a
// block of its own device memory (ExportedMemory: made with cuMemCreate,
// exported once as a POSIX file descriptor that travels over the
// connection's Unix socket, imported and mapped once by the peer), and sends
// a BlockRecord in the segment's place. The small segments of one frame
// (up to kPackMaxBytes each) share one block, at aligned offsets, and every
// segment of a frame on one device is copied by one kernel launch (a
// gather from its descriptor table). The receiver's tensor is a view of the
// mapped block for as long as it lives (the segments of one block share a
// lease). When the last view dies, the block goes back to the sender's pool
// (kBlockRelease) and is reused for the next segment that fits. A received
// storage sent back to the peer it came from, with nothing else holding it
// or its block, is handed back with no copy (kReturned).
//
// No host thread waits on the GPU. Each block has two interprocess events,
// made by its owner and opened by the peer: `ready`, recorded by whoever
// filled the block after the copy, which the receiver's streams wait on
// (DeviceRegion::waitOn); and `released`, recorded by whoever used it last
// on the stream of that use before giving it back, which the next copy into
// the block waits on. A block is filled by one side at a time, so each
// event has one record outstanding at a time.
//
// Reach: both ends see the same physical device. A process publishes its
// host (boot id) and the UUIDs of its devices that can share memory; two
// processes reach each other on one host when they share a device, and a
// segment on a device the peer does not see is declined (the next device
// channel, or an error naming the device, follows).
//
// Legacy handles. Where either end's device cannot export a descriptor
// (no VMM), blocks are made with cuMemAlloc and named by legacy IPC handles
// (Sharing::kLegacy; both processes must share a PID namespace). Such memory
// dies with its owner, so the receiver does not view it: it copies the
// frame's segments out, with one launch per block on its own stream after
// `ready`, each into a block of its own (the device's StagingPool, as
// cuda_staged lands), records `released` after that launch and releases
// the block at once. Two copies per direction; no hand-back.

// Its control frames: the lending channels' three (lending.h), and the
// importer's answer to a drop.
//
// A drop has two phases, as cuda.h wants: an exported event may not be
// destroyed while another process has it open, nor legacy memory freed
// before the importer's cuIpcCloseMemHandle. The owner sends kBlockDrop and
// keeps the block (State::kDropping); the importer unmaps it, closes its
// events and answers kBlockDropped; only then does the owner free it.
enum IpcFrame : uint8_t {
  kBlockSetup = kLendSetup, // BlockSetup + the block's file descriptor
  kBlockRelease = kLendRelease, // uint32 ids the receiver no longer uses
  kBlockDrop = kLendDrop, // uint32 id: the owner unmaps an idle block
  kBlockDropped = 3, // uint32 id: the importer closed it; the owner frees it
                     // (+ why, unasked: it could not map it; protocol 13)
  kGrant = 4, // GrantSetup: landing memory of the receiver's, for the sender
  kGrantEvent = 5, // GrantEventSetup: the sender's event for grants' writes
  kGrantRevoke = 6, // uint32 ids: the receiver takes back grants not used
  kGrantReturned = 7, // uint32 ids: the sender will not write them (again)
};

// Grants (docs/cuda.md, "Grants"): a receiver whose landings use the
// landing pool grants its peer, per device, a block of it the size of the
// last large segment it landed from it; the peer writes its next large
// segment that fits straight into it (one copy a direction, no landing
// copy), records its grant event, and sends a kGranted record. The memory
// is a legacy-IPC-shared segment of the receiver's pool (one PID namespace).
// A segment that fits no grant out earns one of its size, in a free slot,
// or in the slot of the oldest grant, which is revoked (kGrantRevoke): the
// sender gives back one it has not used (kGrantReturned), or answers
// nothing where its record of the grant's use is on its way; a grant it
// used for a frame it then did not send goes back, unasked, once its copy
// into it has completed. Each grant ends in one record or one return.
#pragma pack(push, 1)
struct GrantSetup {
  uint32_t id;
  uint32_t device; // the receiver's device index
  uint64_t bytes;
  uint64_t offset; // of the block in the segment
  uint64_t segmentKey; // the receiver's, unique per allocation of a segment
  uint64_t segmentSize;
  CUipcMemHandle segment;
  // The receiver's event for the device's grants, recorded after the
  // block's allocation: the sender's copy waits on it (one event per
  // device, the same handle in every grant of it).
  CUipcEventHandle free;
  // Below kGrantSlots: whose events the copy waits on and records (last,
  // so that the fields before it stay aligned).
  uint32_t slot;
};
struct GrantEventSetup {
  uint32_t device; // the receiver's device index the writes are for
  uint32_t slot; // ... into its grants of this slot
  CUipcEventHandle event;
};
#pragma pack(pop)
static_assert(sizeof(GrantSetup) == 172, "GrantSetup layout is fixed");
static_assert(sizeof(GrantEventSetup) == 72, "GrantEventSetup layout is fixed");

// Segments over this size, contiguous, may go into a grant (those with a
// block of their own: kPackMaxBytes below).
constexpr uint64_t kGrantMinBytes = uint64_t(1) << 20;
// A grant names a segment of at most this many bytes, and a sender keeps
// at most this many of a peer's segments open (a peer that names more
// closes the connection; a receiver makes no grant in one more).
constexpr uint64_t kMaxGrantSegmentBytes = uint64_t(1) << 40;
constexpr size_t kMaxPeerSegments = 64;
// At most this many grants out per connection, direction and device, each
// in a slot of its own with its own pair of events (the receiver's "free",
// the sender's "written"): a slot's events are recorded again only for the
// slot's next grant, made once the last one ended. Two, so that two sizes
// of segment taking turns (a forward's and a backward's, say) each have
// one.
constexpr uint32_t kGrantSlots = 2;
// A segment goes into a grant of at least its size and at most this many
// times it: the tensor holds the whole grant, so a small one never pins a
// block many times its size. Receiver and sender judge fit alike.
constexpr uint64_t kGrantSlack = 2;
inline bool grantFits(uint64_t grantBytes, uint64_t segmentBytes) {
  return segmentBytes <= grantBytes && grantBytes / kGrantSlack <= segmentBytes;
}

// A grant's share of its device's bound on cuda_ipc's memory (device_memory.h,
// reserveGrant), given back as the grant ends, however it ends.
class GrantClaim {
 public:
  GrantClaim() = default;
  GrantClaim(int device, uint64_t bytes) : device_(device), bytes_(bytes) {}
  GrantClaim(GrantClaim&& other) noexcept
      : device_(other.device_), bytes_(other.bytes_) {
    other.bytes_ = 0;
  }
  GrantClaim& operator=(GrantClaim&& other) noexcept {
    if (this != &other) {
      reset();
      device_ = other.device_;
      bytes_ = other.bytes_;
      other.bytes_ = 0;
    }
    return *this;
  }
  ~GrantClaim() {
    reset();
  }
  void reset();

 private:
  int device_ = 0;
  uint64_t bytes_ = 0;
};

// What travels in the stream in place of a segment's bytes.
struct BlockRecord {
  enum Kind : uint32_t {
    kLent = 1, // the sender's block `id` (kFd)
    kReturned = 2, // the receiver's own block `id`, handed back
    kCopyOut = 3, // the sender's block `id` (kLegacy): copy the bytes out
    kCopyOutLast = 4, // ... the last of the frame's in it: then release it
    kGranted = 5, // written into the receiver's grant `id` (offset 0)
  };
  uint32_t id;
  uint32_t kind;
  uint64_t offset;
};
static_assert(sizeof(BlockRecord) == 16, "BlockRecord is 16 bytes");

// Per connection and direction: at most this many blocks, and this many
// bytes of them lent at once; past either the segment is declined.
constexpr size_t kMaxBlocks = 256;
constexpr uint64_t kMaxLentBlockBytes = uint64_t(16) << 30;
// A peer's legacy block holds at most this many segments of one frame (a
// record past it closes the connection).
constexpr size_t kMaxCopyOutBatch = size_t(1) << 16;
// After the connection closed, freeing the channel's legacy blocks waits
// this long at most for copies out of them still running.
constexpr int64_t kLegacyTeardownWaitMs = 2000;
// ... and past it, while the peer lives, a legacy block still lent at the
// close (its frame perhaps unread) waits at most this much more for the
// peer's copy out of it to be seen queued (block.cpp).
constexpr int64_t kLentAtCloseWaitMs = 30000;
// A free block unused this long is unmapped, and the peer told.
constexpr int64_t kBlockIdleMs = 5000;
// A graceful shutdown (settleFromLoop()): every free block is dropped at
// once and the peer's answers awaited, steps this far apart, for this long
// at most; a block lent at its start may still come back (a release on its
// way) for kSettleLentMs, after which it is taken as held by the peer's
// user (a zero-copy view) and left to the close.
constexpr int64_t kSettleStepMs = 1;
constexpr int64_t kSettleForMs = 2000;
constexpr int64_t kSettleLentMs = 100;
// Segments up to this size, of one frame and device, are packed into one
// block, each at an offset aligned to kPackAlign (as cudaMalloc's).
constexpr uint64_t kPackMaxBytes = uint64_t(1) << 20;
static_assert(kGrantMinBytes == kPackMaxBytes, "grants take unpacked ones");
constexpr uint64_t kPackAlign = 256;
// Releases of blocks up to this size wait to ride with our next frame (RPC
// traffic goes both ways: a request's block goes back with its response,
// a response's with the next request), at most kMaxPendingReleases of them
// and at most kReleaseRideMs (a slow function, a one-way burst: the owner's
// blocks are not held for long): a release frame of its own costs a socket
// write and a wake-up of the peer's loop per message. A larger block goes
// back at once, so that its owner does not make another meanwhile.
constexpr uint64_t kDeferredReleaseBytes = uint64_t(8) << 20;
constexpr size_t kMaxPendingReleases = 32;
constexpr int64_t kReleaseRideMs = 10;
// How long a release waits for a ride ($TORCH_RPC_EXT_CUDA_RELEASE_RIDE_MS,
// 0..10000, checked when the channel is probed; 0: at once, no ride).
void setReleaseRideMs(int64_t ms);
int64_t releaseRideMs();

struct IpcCounters {
  std::atomic<uint64_t> segments{0};
  std::atomic<uint64_t> copiedBytes{0};
  std::atomic<uint64_t> handedBack{0};
  std::atomic<uint64_t> created{0}; // blocks made
  std::atomic<uint64_t> imported{0}; // peers' blocks mapped
  std::atomic<uint64_t> unmapped{0}; // own idle blocks dropped (and freed)
  // Segments on a device the peer does not see, or over the bounds.
  std::atomic<uint64_t> declined{0};
  std::atomic<uint64_t> launches{0}; // copies of frames (one per device)
  std::atomic<uint64_t> packed{0}; // segments that shared a block
  std::atomic<uint64_t> legacyBlocks{0}; // of `created`, kLegacy ones
  std::atomic<uint64_t> copiedOut{0}; // segments copied out of kLegacy ones
  // ... not, for want of our device memory (their messages failed)
  std::atomic<uint64_t> copyOutsFailed{0};
  std::atomic<uint64_t> releases{0}; // peers' blocks given back
  std::atomic<uint64_t> releaseFrames{0}; // the frames that said so
  std::atomic<uint64_t> grantsMade{0}; // landing memory granted to peers
  std::atomic<uint64_t> grantsUsed{0}; // segments written into a peer's grant
  std::atomic<uint64_t> grantsRevoked{0}; // ours taken back as too small
  std::atomic<uint64_t> grantsReturned{0}; // the peer's given back by us
  // Not made: in a segment past those the peer may keep open.
  std::atomic<uint64_t> grantsCapped{0};
  std::atomic<uint64_t> grantsIdle{0}; // of grantsRevoked: unused too long
  // Not made: past the device's bound (cuda_ipc_memory_limit).
  std::atomic<uint64_t> grantsOverLimit{0};
  // The peer's blocks this process could not map (their messages failed),
  // and the connections on which the peer could not map ours (lending
  // stopped: segments go by the next channel).
  std::atomic<uint64_t> blocksRefused{0};
  std::atomic<uint64_t> lendingRefused{0};
};

// A process's cuda_ipc domain descriptor, as published at rendezvous:
// "<boot id>;<device>,<device>,...;<PID namespace>;<pid>", one device per
// index: its UUID where it exports memory as a descriptor, "~" and its UUID
// where it has legacy handles only, "-" where it shares no memory; after a
// descriptor device's UUID, "+<index>" for each other device of the process
// that can read its memory peer to peer (what lets a peer send a block of
// that device for a tensor of the other: a map {0: 1} on one node).
struct IpcDomain {
  struct Device {
    std::string uuid; // "": shares no memory
    bool fd = false;
    std::vector<int> peers; // indices of the devices that reach it (fd only)
  };
  std::string host;
  std::vector<Device> devices;
  std::string pidNamespace;
  std::string pid; // "": not published (then never taken for our own)

  static IpcDomain parse(const std::string& descriptor);
  std::string format() const;
  // How a block of the device `uuid` goes from a process of this domain to
  // one of `peer`: kFd where both export descriptors, else kLegacy within
  // one PID namespace; nothing where either lacks the device, or where the
  // peer is this very process (a worker's calls to itself): the driver
  // opens IPC handles, events' and legacy memory's, only in a process other
  // than the one that made them (as TensorPipe, cuda_staged carries those).
  std::optional<Sharing> sharingWith(
      const IpcDomain& peer,
      const std::string& uuid) const;
};

class IpcChannel final : public Channel,
                         public std::enable_shared_from_this<IpcChannel> {
 public:
  IpcChannel(
      std::shared_ptr<const Context> context,
      std::weak_ptr<Host> host,
      IpcCounters& counters,
      const IpcDomain& local,
      const IpcDomain& peer);
  ~IpcChannel() override;

  void takeRegions(
      const std::vector<frame::OutboundFrame::Segment>& segments,
      const std::vector<size_t>& offered,
      std::vector<TakenRegion>* taken,
      std::vector<ControlFrame>* before,
      const std::shared_ptr<void>& keepAlive) override;
  void abandonRegion(
      const frame::OutboundFrame::Segment& segment,
      const frame::SegmentRecord& record) override;

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
    return 1; // a kBlockSetup frame's descriptor
  }
  bool onFrameEndFromLoop() override;
  void collectPendingLocked(std::vector<ControlFrame>* out) override;
  void onTickFromLoop() override;
  void onClosedFromLoop() override;
  void settleFromLoop() override;
  bool settled() override;

  // From a lease's destructor, any thread, after recording the block's
  // `released` event: the peer's block `id` (of `bytes`) goes back to the
  // peer (with our next frame, or at once: kDeferredReleaseBytes), or our
  // own block `id` (handed back to us) is free again.
  void releasePeerBlock(uint32_t id, uint64_t bytes);
  void freeOwnBlock(uint32_t id);

 private:
  // A block of ours lent for one frame: `fresh` if made for it.
  struct Lent {
    uint32_t id = 0;
    std::shared_ptr<Block> block;
    bool fresh = false;
  };
  // Whether the peer can map `segment`'s device, as its map wants: the
  // block lives on the segment's device and is mapped on that one.
  bool reachable(const frame::OutboundFrame::Segment& segment);
  // Whether our `target` reads memory of our `device` peer to peer
  // (canAccessPeer, asked once per pair; loop thread).
  bool reaches(int target, int device);
  std::map<std::pair<int, int>, bool> reach_;
  // A storage the peer lent us, sent back whole: its record, or false.
  bool handBack(
      const frame::OutboundFrame::Segment& segment,
      frame::SegmentRecord* out);
  // A free block of `device` of at least `want` bytes from the pool, or a
  // new one (its setup frame appended to `before`); id 0 when over the
  // bounds.
  Lent lend(int device, uint64_t want, std::vector<ControlFrame>* before);
  // A block lent for a frame that will not use it goes back to the pool
  // (the peer knows of a fresh one already: its setup is sent regardless).
  void unlend(const Lent& lent);
  // The segments `group` (one device and stream) into blocks, with one
  // launch; appends their records to `taken`.
  void takeGroup(
      const std::vector<frame::OutboundFrame::Segment>& segments,
      const std::vector<size_t>& group,
      std::vector<TakenRegion>* taken,
      std::vector<ControlFrame>* before);
  bool onSetupFromLoop(
      Host& host,
      const std::string& head,
      std::vector<int>& fds);
  bool onReleaseFromLoop(Host& host, const std::string& head);
  bool onDropFromLoop(Host& host, const std::string& head);
  bool onDroppedFromLoop(Host& host, const std::string& head);
  // The peer's dropped blocks whose imports nothing uses any more are
  // closed, and each answered with kBlockDropped.
  void closeDropped();
  // A kCopyOut record: the bytes copied out of the peer's kLegacy `block`
  // into memory of ours, which the segment then views; -1 after rejecting.
  int64_t copyOutFromLoop(
      const BlockRecord& record,
      const std::shared_ptr<Block>& block,
      InboundSegment& segment);
  // Drops our free blocks unused for `idleFor` whose device work is done.
  void trim(std::chrono::milliseconds idleFor);
  // Sends the releases waiting for a ride now.
  void flushReleases();
  // The ride's timer: sends the batch waiting once it is the ride's wait
  // old, or waits on for a younger one.
  void armRide(Host& host, std::chrono::milliseconds after);

  std::weak_ptr<Host> host_;
  // A graceful shutdown's settling: since when (0: not settling, or over),
  // and whether its next step is posted (loop thread).
  std::atomic<int64_t> settlingSinceNs_{0};
  bool settleStepArmed_ = false;
  // One step of settleFromLoop(), then the next posted until settled().
  void settleStep();
  std::mutex releaseMutex_;
  std::string pendingReleases_; // ids (idHead) waiting for our next frame
  std::chrono::steady_clock::time_point batchSince_; // its first release
  bool rideArmed_ = false; // a timer for pendingReleases_ is pending
  IpcCounters& counters_;
  // UUIDs of the peer's devices by its index ("": one that shares none),
  // and by the same index the peer's devices that reach each peer to peer.
  std::vector<std::string> peerDevices_;
  std::vector<std::vector<int>> peerReach_;
  // UUID -> our device index, for the devices we see.
  std::map<std::string, int> localDevices_;
  // Device index -> how its blocks reach this peer and their granularity,
  // for the devices whose blocks can.
  std::map<int, Sharing> sharing_;
  std::map<int, uint64_t> granularity_;
  bool markLast_ = true; // kCopyOutLast on a legacy block's last record

  // The peer's blocks we have mapped, by id (loop thread).
  std::unordered_map<uint32_t, std::shared_ptr<Block>> peerBlocks_;
  // ... and those we could not, with why: a record naming one fails its
  // message (loop thread; counted in the bounds on the peer's blocks).
  std::unordered_map<uint32_t, std::string> refusedBlocks_;
  // Sender: the peer could not map a block of ours; none is lent again on
  // this connection (docs/cuda.md, "A block the peer cannot map").
  std::atomic<bool> lendingRefused_{false};
  uint64_t peerBlockBytes_ = 0;
  // The live lease on each of them (the segments of one frame packed into
  // one block share it; the block is lent again only once it died).
  std::unordered_map<uint32_t, std::weak_ptr<BlockLease>> peerLeases_;
  // The peer dropped these; closed and answered once only this holds them.
  std::vector<std::pair<uint32_t, std::shared_ptr<Block>>> peerDropped_;
  // The copies out of each legacy block of the frame being received, made
  // with one launch at its last record (the frame is refused if it ends
  // with any left); their regions wait on `ready`.
  struct CopyOut {
    std::shared_ptr<Block> block;
    std::vector<CopyEngine::Segment> copies;
    PooledEvent ready;
  };
  std::unordered_map<uint32_t, CopyOut> copyOuts_;
  // This connection's own streams per device (loop thread), so that a
  // peer's record that never completes stalls only them: copies out of
  // legacy blocks wait on its `ready`; joins after peer-to-peer reads of
  // its blocks record their events (BlockLease).
  std::shared_ptr<CUstream_st> copyOutStream(int device) {
    return streamOf(copyOutStreams_, device);
  }
  std::shared_ptr<CUstream_st> joinStream(int device) {
    return streamOf(joinStreams_, device);
  }
  static std::shared_ptr<CUstream_st> streamOf(
      std::map<int, std::shared_ptr<CUstream_st>>& made,
      int device);
  std::map<int, std::shared_ptr<CUstream_st>> copyOutStreams_;
  std::map<int, std::shared_ptr<CUstream_st>> joinStreams_;

  // ---- Grants (ipc_grants.cpp) -------------------------------------------
  // Whether legacy handles reach the peer (one PID namespace, one host).
  bool grantsPossible_ = false;
  // The peer's process, where a device of it shares by legacy handle, or
  // grants may go (our PID namespace): a close waits for its copies out of
  // our legacy blocks, and its writes into our grants, as long as it lives
  // (block.cpp, ipc_grant_ends.cpp).
  std::shared_ptr<const ProcessWatch> peerProcess_;
  // Receiver: a large segment of `size` from the peer landed on `device`
  // (or was written into a grant): a grant for the next may follow.
  void noteLargeFromLoop(int device, uint64_t size);
  // At a frame's end: a grant for each size noted that no grant out fits.
  void postGrantsFromLoop();
  // ... one: true where it revoked a grant to make room.
  bool postGrantFromLoop(
      const std::shared_ptr<GrantSource>& source,
      int device,
      uint64_t bytes);
  // The grants whose memory is free (its stream passed the allocation)
  // and not yet sent (grantMu_ taken here).
  void collectGrantsLocked(std::vector<ControlFrame>* out);
  bool onGrantFromLoop(Host& host, const std::string& head);
  bool onGrantEventFromLoop(Host& host, const std::string& head);
  int64_t onGrantedFromLoop(const BlockRecord& r, InboundSegment& segment);
  // Sender: `segment` written into the peer's grant for its device, on
  // `stream`, its record in `out`; false where none fits.
  bool takeGrant(
      const frame::OutboundFrame::Segment& segment,
      std::vector<ControlFrame>* before,
      frame::SegmentRecord* out);
  // The ends of grants (ipc_grant_ends.cpp). Receiver: the peer gave
  // grants back (their memory is the pool's again; a larger may follow).
  bool onGrantReturnedFromLoop(Host& host, const std::string& head);
  // Sender: the peer takes back grants; those not used go back.
  void onGrantRevokeFromLoop(const std::string& head);
  // Sender: grant `id` was written for a frame that is not sent: it goes
  // back once the copy queued on `stream` is done.
  void abandonGrant(int device, uintptr_t stream, uint32_t id);
  void returnGrants(const std::string& ids); // (any thread)
  // At the close: grants out held until copies the peer queued are over;
  // our imports of the peer's segments closed after our last writes.
  void closeGrantsFromLoop();
  // Receiver: grants the peer left unused for grantIdleMs() are taken back.
  void revokeIdleGrantsFromLoop();
  struct OutGrant {
    GrantMemory memory;
    GrantClaim claim; // (released first: the memory is the pool's after)
    int device = 0;
    int slot = 0;
    uint64_t bytes = 0;
    bool sent = false;
    std::chrono::steady_clock::time_point sentAt;
    // Revoked (a larger segment came, or it stayed unused): `wanted` bytes
    // follow its return (0: none, for idleness).
    bool revoking = false;
    uint64_t wanted = 0;
  };
  struct InGrant {
    int device = 0; // ours
    int slot = 0;
    int peerDevice = 0; // the receiver's index, as it named it
    uint64_t bytes = 0;
    CUdeviceptr address = 0; // 0: its segment did not open (held unused)
    CUevent free = nullptr; // the receiver's, opened (peerFreeEvents_)
  };
  using SlotKey = std::pair<int, int>; // (device, slot)
  // Sender: `id` ended here (used, or given back): a revoke of it that
  // finds nothing is late, not early (revokeGrantLocked).
  void endedGrantLocked(uint32_t id);
  std::mutex grantMu_; // the members below but noted_ and peerGrantEvents_
  std::map<uint32_t, OutGrant> outGrants_;
  uint32_t nextGrantId_ = 1;
  std::string pendingRevokes_; // ids (idHead), riding as releases do
  std::string pendingReturns_;
  std::set<uint64_t> sharedSegments_; // our segments the peer was told of
  std::map<uint32_t, InGrant> inGrants_; // the peer's, by its id
  // Sender: the peer's grants that ended here lately, and revokes that came
  // before the grant they name (control frames sent alone jump ahead of
  // frames queued earlier, a grant riding a message among them): such a
  // grant goes back as it arrives. Both bounded, oldest out first.
  std::deque<uint32_t> endedGrants_;
  std::deque<uint32_t> earlyRevokes_;
  // The peer's segments we opened: key -> (base, (mapped size, our device)).
  std::map<uint64_t, std::pair<CUdeviceptr, std::pair<uint64_t, int>>>
      peerSegments_;
  std::vector<PooledEvent> grantCopies_; // our copies into them, not done
  std::map<SlotKey, CUevent> grantEvents_; // ours (interprocess)
  // Receiver: ours, recorded after each grant's allocation (interprocess),
  // and their handles; sender: the receiver's, opened, by our device.
  std::map<SlotKey, std::pair<CUevent, CUipcEventHandle>> freeEvents_;
  std::map<SlotKey, CUevent> peerFreeEvents_;
  std::shared_ptr<GrantSource> grantSource_; // what our grants came from
  // Loop thread: this frame's large sizes, by device (a few, the largest).
  std::map<int, std::set<uint64_t>> noted_;
  std::map<SlotKey, std::shared_ptr<CUevent_st>> peerGrantEvents_;

  struct OwnBlock {
    // kDropping: the peer was told to close it and has not answered.
    enum class State { kFree, kLent, kLocal, kDropping };
    std::shared_ptr<Block> block;
    State state = State::kFree;
    std::chrono::steady_clock::time_point lastUsed;
    // The peer released it or handed it back once: it mapped it, so a
    // refusal of it (kBlockDropped with a reason) is a lie.
    bool peerUsed = false;
    // Set (any thread) once its setup frame is written or dropped: a block
    // of a frame refused at send is free while its setup may still wait
    // in the queue, which a drop would overtake (trim()).
    std::shared_ptr<std::atomic<bool>> announced =
        std::make_shared<std::atomic<bool>>(false);
  };
  std::mutex mu_; // the members below; never held across a driver call
  std::unordered_map<uint32_t, OwnBlock> ownBlocks_;
  uint32_t nextBlockId_ = 1;
  size_t blocksBeingMade_ = 0;
  uint64_t lentBytes_ = 0;
};

// The process's cuda_ipc (registry.cpp). Loads the driver only when asked
// whether it is viable or for its descriptor.
std::shared_ptr<Context> createIpcChannel(WireIds ids);

} // namespace torch_rpc_ext::channel::cuda
