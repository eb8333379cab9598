// SPDX-License-Identifier: BSD-3-Clause
// shm_slab (slab_channel.h): our pool of slabs lent to the peer, the peer's
// slabs we map, and the leases that tie a received tensor's storage to a
// slab.
#include "csrc/channel/shm/slab_channel.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::shm {

namespace {

using frame::FrameKind;
using frame::SegmentRecord;

// The peer may have at most this many slabs, of this many bytes, mapped
// into us: twice what it may own, for the slabs it unmapped whose drops
// are still on their way (a trim, on its loop thread, erases them before
// it queues their drops; a new slab made meanwhile is announced after).
constexpr size_t kMaxPeerSlabs = 2 * kMaxSlabs;
uint64_t maxPeerSlabBytes() {
  return 2 * slabBytesBound();
}
// Releases of slabs smaller than this wait to ride with our next frame (RPC
// traffic goes both ways, so one comes soon), at most kMaxPendingReleases of
// them and at most until the next heartbeat tick: a release frame of its own
// costs a send and a wake-up of the peer's loop, more than a small slab is
// worth (a timer to bound the wait cost as much: it wakes our own loop). A
// large slab goes back at once so that its owner does not map another one
// meanwhile.
constexpr uint64_t kDeferredReleaseBytes = uint64_t(1) << 20;
constexpr size_t kMaxPendingReleases = 64;

// A received segment's memory: a span of a slab, valid while this lives.
// When the last tensor viewing it dies, the slab goes back to its owner:
// the peer (kSlabRelease) for a lent slab, our pool for one of ours the
// peer handed back. handOn() passes the peer's slab back to it in a frame
// instead.
class SlabLease final : public frame::SharedRegion {
 public:
  SlabLease(
      std::weak_ptr<SlabChannel> conn,
      std::shared_ptr<Slab> slab,
      uint32_t id,
      bool own)
      : conn_(std::move(conn)), slab_(std::move(slab)), id_(id), own_(own) {}

  ~SlabLease() override {
    if (handedOn_.load()) {
      return;
    }
    // A destroyed connection has nobody left to tell.
    if (auto c = conn_.lock()) {
      if (own_) {
        c->freeOwnSlab(id_);
      } else {
        c->releasePeerSlab(id_, slab_->capacity());
      }
    }
  }

  // Whether this lease came from `channel` (a live one: a new channel may
  // sit at a closed one's address).
  bool isOf(const SlabChannel* channel) const {
    return conn_.lock().get() == channel;
  }
  const Slab& slab() const {
    return *slab_;
  }
  uint32_t id() const {
    return id_;
  }
  bool own() const {
    return own_;
  }
  // True once, for the one frame that passes the slab on.
  bool handOn() {
    return !handedOn_.exchange(true);
  }
  // That frame was not sent after all: the lease gives the slab back itself.
  void keep() {
    handedOn_.store(false);
  }

 private:
  std::weak_ptr<SlabChannel> conn_;
  std::shared_ptr<Slab> slab_;
  uint32_t id_;
  bool own_;
  std::atomic<bool> handedOn_{false};
};

} // namespace

SlabChannel::SlabChannel(
    std::shared_ptr<const Context> context,
    std::weak_ptr<Host> host,
    SlabCounters& counters)
    : Channel(std::move(context)),
      host_(std::move(host)),
      counters_(counters) {}

bool SlabChannel::takeRegion(
    const frame::OutboundFrame::Segment& segment,
    SegmentRecord* out,
    std::vector<ControlFrame>* before) {
  if (segment.size < kSlabMinSegment) {
    return false;
  }
  static_assert(sizeof(SlabRecord) == sizeof(*out));
  const bool warm = offers_.offerIsWarm();
  // A storage that lives in a slab the peer lent us on this connection,
  // and that nothing else can reach any more, goes back as it is. (Our own
  // slabs handed back to us are copied like any memory when sent again:
  // from Python that is always the case, as the caller's argument tuple
  // still holds the tensor while the call is encoded.)
  if (segment.exclusive && segment.origin != nullptr) {
    auto* lease = dynamic_cast<SlabLease*>(segment.origin.get());
    const char* p = static_cast<const char*>(segment.data);
    if (lease != nullptr && lease->isOf(this) && !lease->own() &&
        p >= lease->slab().data() && segment.size <= lease->slab().capacity() &&
        uint64_t(p - lease->slab().data()) <=
            lease->slab().capacity() - segment.size &&
        lease->handOn()) {
      SlabRecord r{
          lease->id(),
          SlabRecord::kReturned,
          uint64_t(p - lease->slab().data())};
      counters_.handedBack.fetch_add(1, std::memory_order_relaxed);
      counters_.segments.fetch_add(1, std::memory_order_relaxed);
      std::memcpy(out, &r, sizeof(r));
      return true;
    }
  }
  std::shared_ptr<Slab> slab;
  uint32_t id = 0;
  uint64_t want = slabCapacityFor(segment.size);
  {
    std::lock_guard<std::mutex> lock(slabMutex_);
    // The smallest free slab that fits without wasting more than half.
    uint64_t best = std::numeric_limits<uint64_t>::max();
    for (auto& [slabId, own] : ownSlabs_) {
      if (own.state != OwnSlab::State::kFree) {
        continue;
      }
      uint64_t cap = own.slab->capacity();
      if (cap >= want && cap <= 2 * want && cap < best) {
        best = cap;
        id = slabId;
      }
    }
    if (closed_) {
      return false; // nothing is sent any more (onClosedFromLoop)
    } else if (id != 0) {
      auto& own = ownSlabs_[id];
      own.state = OwnSlab::State::kLent;
      slab = own.slab;
    } else if (!warm) {
      // A one-off: a new slab would cost more than it saves.
      counters_.oneOffs.fetch_add(1, std::memory_order_relaxed);
      counters_.declined.fetch_add(1, std::memory_order_relaxed);
      return false;
    } else if (
        ownSlabs_.size() + slabsBeingMapped_ >= kMaxSlabs ||
        ownSlabBytes_ + want > slabBytesBound()) {
      counters_.declined.fetch_add(1, std::memory_order_relaxed);
      return false;
    } else {
      // Counted against the bounds now, mapped below without the lock, and
      // entered in ownSlabs_ only once it exists: the peer cannot name it
      // before its setup frame, which follows.
      id = nextSlabId_++;
      ownSlabBytes_ += want;
      ++slabsBeingMapped_;
    }
  }
  if (slab == nullptr) {
    try {
      slab = Slab::create(want);
    } catch (const std::exception& e) {
      logDebug(
          std::string(
              "torch_rpc_ext: no slab, the next channel takes the "
              "segment: ") +
          e.what());
      std::lock_guard<std::mutex> lock(slabMutex_);
      --slabsBeingMapped_;
      ownSlabBytes_ -= want;
      counters_.declined.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    {
      std::lock_guard<std::mutex> lock(slabMutex_);
      --slabsBeingMapped_;
      if (closed_) {
        // The connection closed while we made it: entered now, it would
        // stay mapped as long as anything holds the closed connection
        // (before session 94). It goes with `slab`.
        ownSlabBytes_ -= want;
        return false;
      }
      ownSlabs_.emplace(id, OwnSlab{slab, OwnSlab::State::kLent, {}});
    }
    counters_.created.fetch_add(1, std::memory_order_relaxed);
    // A new slab reaches the peer before the first record naming it. Once
    // the frame is out (or dropped) we need the descriptor no more: the
    // mapping lives on without it.
    uint64_t capacity = slab->capacity();
    std::string head = idHead(id);
    head.append(reinterpret_cast<const char*>(&capacity), sizeof(capacity));
    before->push_back(
        ControlFrame{
            context().wireIds().kind(kSlabSetup),
            std::move(head),
            {slab->fd()},
            std::shared_ptr<void>(
                nullptr, [slab](void*) { slab->closeFd(); })});
  }
  // The one copy of this direction.
  std::memcpy(slab->data(), segment.data, segment.size);
  SlabRecord r{id, SlabRecord::kLent, 0};
  counters_.segments.fetch_add(1, std::memory_order_relaxed);
  counters_.copiedBytes.fetch_add(segment.size, std::memory_order_relaxed);
  std::memcpy(out, &r, sizeof(r));
  return true;
}

void SlabChannel::releasePeerSlab(uint32_t id, uint64_t capacity) {
  auto host = host_.lock();
  if (!host || host->isClosed()) {
    return; // nobody left to tell
  }
  bool now = capacity >= kDeferredReleaseBytes;
  {
    std::lock_guard<std::mutex> lock(releaseMutex_);
    pendingReleases_ += idHead(id);
    now = now ||
        pendingReleases_.size() >= kMaxPendingReleases * sizeof(uint32_t);
  }
  if (now) {
    flushReleases();
  }
}

void SlabChannel::flushReleases() {
  auto host = host_.lock();
  if (!host || host->isClosed()) {
    return;
  }
  host->sendPendingControl(); // collectPendingLocked, under the write lock
}

void SlabChannel::collectPendingLocked(std::vector<ControlFrame>* out) {
  // Releases waiting for a ride take this one.
  std::lock_guard<std::mutex> lock(releaseMutex_);
  if (!pendingReleases_.empty()) {
    out->push_back(takeReleasesLocked());
  }
}

ControlFrame SlabChannel::takeReleasesLocked() {
  ControlFrame frame{
      context().wireIds().kind(kSlabRelease),
      std::move(pendingReleases_),
      {},
      nullptr};
  pendingReleases_.clear();
  return frame;
}

void SlabChannel::onTickFromLoop() {
  // Memory goes back once traffic stops: releases still waiting for a frame
  // to ride with, and our free slabs idle for kSlabIdleMs.
  flushReleases();
  trim();
}

void SlabChannel::onClosedFromLoop() {
  // Nothing lands in the peer's slabs or is lent from ours any more, but a
  // request still served for the peer holds its connection, and with it
  // this channel, as long as it runs: unmap now what only the channel
  // holds (a lease, a tensor's, keeps its own slab).
  peerSlabs_.clear();
  peerSlabBytes_ = 0;
  std::unordered_map<uint32_t, OwnSlab> own;
  std::lock_guard<std::mutex> lock(slabMutex_);
  closed_ = true; // a slab being made is not entered (takeRegion)
  own.swap(ownSlabs_); // (ownSlabBytes_ stays as counted: no underflow)
}

void SlabChannel::abandonRegion(
    const frame::OutboundFrame::Segment& segment,
    const SegmentRecord& record) {
  SlabRecord r;
  std::memcpy(&r, &record, sizeof(r));
  if (r.kind == SlabRecord::kReturned) {
    if (auto* lease = dynamic_cast<SlabLease*>(segment.origin.get())) {
      lease->keep();
    }
    counters_.handedBack.fetch_sub(1, std::memory_order_relaxed);
  } else {
    // Lent, but the peer never hears of it: ours again (the copy into it
    // is done: it ran on the sender's thread).
    std::lock_guard<std::mutex> lock(slabMutex_);
    auto it = ownSlabs_.find(r.id);
    if (it != ownSlabs_.end() && it->second.state == OwnSlab::State::kLent) {
      it->second.state = OwnSlab::State::kFree;
      it->second.lastUsed = std::chrono::steady_clock::now();
    }
  }
  counters_.segments.fetch_sub(1, std::memory_order_relaxed);
}

void SlabChannel::freeOwnSlab(uint32_t id) {
  std::lock_guard<std::mutex> lock(slabMutex_);
  auto it = ownSlabs_.find(id);
  if (it != ownSlabs_.end() && it->second.state == OwnSlab::State::kLocal) {
    it->second.state = OwnSlab::State::kFree;
    it->second.lastUsed = std::chrono::steady_clock::now();
  }
}

void SlabChannel::trim() {
  std::vector<uint32_t> dropped;
  {
    std::lock_guard<std::mutex> lock(slabMutex_);
    auto now = std::chrono::steady_clock::now();
    for (auto it = ownSlabs_.begin(); it != ownSlabs_.end();) {
      // A drop goes ahead of the frames queued (sendControl), so a slab
      // whose setup frame still waits in the queue stays: a frame that
      // could not be sent (abandonRegion) leaves such a slab free behind a
      // peer that stopped reading, and the peer would read our drop of a
      // slab it never heard of first. Its descriptor closes once the setup
      // is out (session 94; a helper's reading in session 93 found it).
      if (it->second.state == OwnSlab::State::kFree &&
          it->second.slab->fd() < 0 &&
          now - it->second.lastUsed >= std::chrono::milliseconds(kSlabIdleMs)) {
        dropped.push_back(it->first);
        ownSlabBytes_ -= it->second.slab->capacity();
        it = ownSlabs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  counters_.unmapped.fetch_add(dropped.size(), std::memory_order_relaxed);
  auto host = host_.lock();
  if (!host) {
    return;
  }
  for (uint32_t id : dropped) {
    host->sendControl(
        ControlFrame{
            context().wireIds().kind(kSlabDrop), idHead(id), {}, nullptr});
  }
}

bool SlabChannel::acceptsControlFrame(FrameKind kind, uint32_t headLength)
    const {
  return lendingFrameFits(
      context().wireIds(),
      kind,
      headLength,
      sizeof(uint32_t) + sizeof(uint64_t));
}

bool SlabChannel::onControlFrameFromLoop(
    FrameKind kind,
    const std::string& head,
    std::vector<int>& fds) {
  auto host = host_.lock();
  if (!host) {
    return false;
  }
  switch (context().wireIds().offsetOf(kind)) {
    case kSlabSetup:
      return onSetupFromLoop(*host, head, fds);
    case kSlabRelease:
      return onReleaseFromLoop(*host, head);
    case kSlabDrop:
      return onDropFromLoop(*host, head);
    default: // acceptsControlFrame() let no other kind through
      return true;
  }
}

bool SlabChannel::onSetupFromLoop(
    Host& host,
    const std::string& head,
    std::vector<int>& fds) {
  if (fds.empty()) {
    host.rejectFromLoop("rejected frame: slab setup without its descriptor");
    return false;
  }
  int fd = fds.front();
  fds.erase(fds.begin());
  uint32_t id;
  uint64_t capacity;
  std::memcpy(&id, head.data(), sizeof(id));
  std::memcpy(&capacity, head.data() + sizeof(id), sizeof(capacity));
  std::shared_ptr<Slab> slab;
  std::string why = Slab::attach(fd, capacity, &slab);
  if (why.empty() && peerSlabs_.count(id) != 0) {
    why = "slab " + std::to_string(id) + " announced twice";
  }
  if (why.empty() &&
      (peerSlabs_.size() >= kMaxPeerSlabs ||
       capacity >
           maxPeerSlabBytes() - std::min(peerSlabBytes_, maxPeerSlabBytes()))) {
    why = "the peer's slabs exceed " + std::to_string(kMaxPeerSlabs) + " or " +
        std::to_string(maxPeerSlabBytes()) + " bytes";
  }
  if (!why.empty()) {
    host.rejectFromLoop("rejected slab: " + why);
    return false;
  }
  peerSlabBytes_ += capacity;
  peerSlabs_.emplace(id, std::move(slab));
  return true;
}

bool SlabChannel::onReleaseFromLoop(Host& host, const std::string& head) {
  uint32_t unheld = 0;
  bool ok = true;
  {
    std::lock_guard<std::mutex> lock(slabMutex_);
    auto now = std::chrono::steady_clock::now();
    for (uint32_t id : idsOf(head)) {
      auto it = ownSlabs_.find(id);
      if (it == ownSlabs_.end() || it->second.state != OwnSlab::State::kLent) {
        ok = false;
        unheld = id;
        break;
      }
      it->second.state = OwnSlab::State::kFree;
      it->second.lastUsed = now;
    }
  }
  if (!ok) {
    // No risk to us, but a peer that loses track of its leases is broken.
    host.rejectFromLoop(
        "rejected frame: the peer released slab " + std::to_string(unheld) +
        ", which it does not hold");
    return false;
  }
  trim();
  return !host.isClosed();
}

bool SlabChannel::onDropFromLoop(Host& host, const std::string& head) {
  uint32_t id;
  std::memcpy(&id, head.data(), sizeof(id));
  auto it = peerSlabs_.find(id);
  if (it == peerSlabs_.end()) {
    host.rejectFromLoop(
        "rejected frame: the peer dropped slab " + std::to_string(id) +
        ", which it never announced");
    return false;
  }
  // Leases of ours (there should be none) keep their own mapping.
  peerSlabBytes_ -= it->second->capacity();
  peerSlabs_.erase(it);
  return true;
}

int64_t SlabChannel::onRecordFromLoop(
    const SegmentRecord& record,
    InboundSegment& segment) {
  SlabRecord r;
  static_assert(sizeof(r) == sizeof(record));
  std::memcpy(&r, &record, sizeof(r));
  uint64_t size = segment.size;
  std::shared_ptr<Slab> slab;
  bool own = r.kind == SlabRecord::kReturned;
  std::string why;
  if (r.kind == SlabRecord::kLent) {
    auto it = peerSlabs_.find(r.id);
    if (it == peerSlabs_.end()) {
      why = "record names unknown slab " + std::to_string(r.id);
    } else {
      slab = it->second;
    }
  } else if (own) {
    std::lock_guard<std::mutex> lock(slabMutex_);
    auto it = ownSlabs_.find(r.id);
    if (it == ownSlabs_.end() || it->second.state != OwnSlab::State::kLent) {
      why = "the peer handed back slab " + std::to_string(r.id) +
          ", which it does not hold";
    } else {
      slab = it->second.slab;
      it->second.state = OwnSlab::State::kLocal;
    }
  } else {
    why = "unknown slab record kind " + std::to_string(r.kind);
  }
  if (why.empty() &&
      (r.offset > slab->capacity() || size > slab->capacity() - r.offset)) {
    why = "segment of " + std::to_string(size) + " bytes at offset " +
        std::to_string(r.offset) + " overruns slab " + std::to_string(r.id);
  }
  if (!why.empty()) {
    if (auto host = host_.lock()) {
      host->rejectFromLoop("rejected frame: " + why);
    }
    return -1;
  }
  *segment.provided = slab->data() + r.offset;
  *segment.region =
      std::make_shared<SlabLease>(weak_from_this(), std::move(slab), r.id, own);
  return static_cast<int64_t>(size);
}

} // namespace torch_rpc_ext::channel::shm
