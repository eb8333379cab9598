// SPDX-License-Identifier: BSD-3-Clause
// The shared-slab side of ShmConnection (slab.h): our pool of
// slabs lent to the peer, the peer's slabs we map, and the leases that tie a
// received tensor's storage to a slab.
#include <cstdlib>
#include <cstring>
#include <limits>

#include "csrc/common/logging.h"
#include "csrc/transport/shm/connection.h"

namespace torch_rpc_ext::transport::shm {

namespace {

// The peer may have at most this many bytes of slabs mapped into us.
constexpr uint64_t kMaxPeerSlabBytes = 2 * kMaxLentSlabBytes;
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
class SlabLease final : public SharedRegion {
 public:
  SlabLease(
      std::weak_ptr<ShmConnection> conn,
      const ShmConnection* via,
      std::shared_ptr<Slab> slab,
      uint32_t id,
      bool own)
      : conn_(std::move(conn)),
        via_(via),
        slab_(std::move(slab)),
        id_(id),
        own_(own) {}

  ~SlabLease() override {
    if (handedOn_.load()) {
      return;
    }
    // A closed or destroyed connection has nobody left to tell.
    if (auto c = conn_.lock()) {
      if (own_) {
        c->freeOwnSlab(id_);
      } else {
        c->releasePeerSlab(id_, slab_->capacity());
      }
    }
  }

  const ShmConnection* via() const {
    return via_;
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

 private:
  std::weak_ptr<ShmConnection> conn_;
  const ShmConnection* via_;
  std::shared_ptr<Slab> slab_;
  uint32_t id_;
  bool own_;
  std::atomic<bool> handedOn_{false};
};

std::string idHead(uint32_t id) {
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

} // namespace

bool ShmConnection::prepareSlabSegment(
    const OutboundFrame::Segment& segment,
    SlabRecord* record,
    std::shared_ptr<Slab>* setup) {
  // Tests only: TORCH_RPC_EXT_TEST_NO_SLABS=1 sends everything through the
  // ring, the path otherwise taken only when the slabs are at their bounds.
  static const bool slabsOff = std::getenv("TORCH_RPC_EXT_TEST_NO_SLABS") != nullptr;
  if (slabsOff || segment.size < kSlabMinSegment) {
    return false;
  }
  auto& counters = counters_;
  // A storage that lives in a slab the peer lent us on this connection,
  // and that nothing else can reach any more, goes back as it is. (Our own
  // slabs handed back to us are copied like any memory when sent again:
  // from Python that is always the case, as the caller's argument tuple
  // still holds the tensor while the call is encoded.)
  if (segment.exclusive && segment.origin != nullptr) {
    auto* lease = dynamic_cast<SlabLease*>(segment.origin.get());
    const char* p = static_cast<const char*>(segment.data);
    if (lease != nullptr && lease->via() == this && !lease->own() &&
        p >= lease->slab().data() &&
        segment.size <= lease->slab().capacity() &&
        uint64_t(p - lease->slab().data()) <=
            lease->slab().capacity() - segment.size &&
        lease->handOn()) {
      record->id = lease->id();
      record->kind = SlabRecord::kReturned;
      record->offset = uint64_t(p - lease->slab().data());
      counters.handedBack.fetch_add(1, std::memory_order_relaxed);
      counters.segments.fetch_add(1, std::memory_order_relaxed);
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
    if (id != 0) {
      auto& own = ownSlabs_[id];
      own.state = OwnSlab::State::kLent;
      lentSlabBytes_ += own.slab->capacity();
      slab = own.slab;
    } else if (
        ownSlabs_.size() + slabsBeingMapped_ >= kMaxSlabs ||
        lentSlabBytes_ + want > kMaxLentSlabBytes) {
      counters.fallbacks.fetch_add(1, std::memory_order_relaxed);
      return false;
    } else {
      // Counted against the bounds now, mapped below without the lock, and
      // entered in ownSlabs_ only once it exists: the peer cannot name it
      // before its setup frame, which follows.
      id = nextSlabId_++;
      lentSlabBytes_ += want;
      ++slabsBeingMapped_;
    }
  }
  if (slab == nullptr) {
    try {
      slab = Slab::create(want);
    } catch (const std::exception& e) {
      logDebug(std::string("torch_rpc_ext: no slab, using the ring: ") + e.what());
      std::lock_guard<std::mutex> lock(slabMutex_);
      --slabsBeingMapped_;
      lentSlabBytes_ -= want;
      counters.fallbacks.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    {
      std::lock_guard<std::mutex> lock(slabMutex_);
      --slabsBeingMapped_;
      ownSlabs_.emplace(id, OwnSlab{slab, OwnSlab::State::kLent, {}});
    }
    counters.created.fetch_add(1, std::memory_order_relaxed);
    *setup = slab;
  }
  // The one copy of this direction.
  std::memcpy(slab->data(), segment.data, segment.size);
  record->id = id;
  record->kind = SlabRecord::kLent;
  record->offset = 0;
  counters.segments.fetch_add(1, std::memory_order_relaxed);
  counters.copiedBytes.fetch_add(segment.size, std::memory_order_relaxed);
  return true;
}

ShmConnection::PendingWrite ShmConnection::slabSetupFrame(
    uint32_t id,
    std::shared_ptr<Slab> slab) {
  uint64_t capacity = slab->capacity();
  std::string head = idHead(id);
  head.append(reinterpret_cast<const char*>(&capacity), sizeof(capacity));
  PendingWrite w = controlFrame(FrameKind::kSlab, std::move(head));
  w.passFds = {slab->fd()};
  // Once the frame is out (or dropped) we need the descriptor no more: the
  // mapping lives on without it.
  w.frame.keepAlive =
      std::shared_ptr<void>(nullptr, [slab](void*) { slab->closeFd(); });
  return w;
}

void ShmConnection::releasePeerSlab(uint32_t id, uint64_t capacity) {
  bool now = capacity >= kDeferredReleaseBytes;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed) {
      return;
    }
    pendingReleases_ += idHead(id);
    now = now ||
        pendingReleases_.size() >= kMaxPendingReleases * sizeof(uint32_t);
  }
  if (now) {
    flushReleases();
  }
}

void ShmConnection::flushReleases() {
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ == State::kClosed || pendingReleases_.empty()) {
      return;
    }
    queueReleasesLocked();
    if (state_ == State::kReady && writes_.size() == 1) {
      error = flushLocked();
    }
  }
  afterFlush(error);
}

void ShmConnection::queueReleasesLocked() {
  PendingWrite w;
  FrameHeader h{kFrameMagic, kProtocolVersion,
                uint8_t(FrameKind::kSlabRelease), 0,
                static_cast<uint32_t>(pendingReleases_.size()), 0, 0};
  w.prefix.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  w.prefix += pendingReleases_;
  pendingReleases_.clear();
  writes_.push_back(std::move(w));
}

void ShmConnection::freeOwnSlab(uint32_t id) {
  std::lock_guard<std::mutex> lock(slabMutex_);
  auto it = ownSlabs_.find(id);
  if (it != ownSlabs_.end() && it->second.state == OwnSlab::State::kLocal) {
    it->second.state = OwnSlab::State::kFree;
    it->second.lastUsed = std::chrono::steady_clock::now();
  }
}

void ShmConnection::trimSlabs() {
  std::vector<uint32_t> dropped;
  {
    std::lock_guard<std::mutex> lock(slabMutex_);
    auto now = std::chrono::steady_clock::now();
    for (auto it = ownSlabs_.begin(); it != ownSlabs_.end();) {
      if (it->second.state == OwnSlab::State::kFree &&
          now - it->second.lastUsed >=
              std::chrono::milliseconds(kSlabIdleMs)) {
        dropped.push_back(it->first);
        it = ownSlabs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  counters_.unmapped.fetch_add(
      dropped.size(), std::memory_order_relaxed);
  for (uint32_t id : dropped) {
    queueControl(uint8_t(FrameKind::kSlabDrop), idHead(id));
  }
}

bool ShmConnection::onSlabSetupFromLoop() {
  if (receivedFds_.empty()) {
    rejectFromLoop("rejected frame: slab setup without its descriptor");
    return false;
  }
  int fd = receivedFds_.front();
  receivedFds_.erase(receivedFds_.begin());
  uint32_t id;
  uint64_t capacity;
  std::memcpy(&id, head_.data(), sizeof(id));
  std::memcpy(&capacity, head_.data() + sizeof(id), sizeof(capacity));
  std::shared_ptr<Slab> slab;
  std::string why = Slab::attach(fd, capacity, &slab);
  if (why.empty() && peerSlabs_.count(id) != 0) {
    why = "slab " + std::to_string(id) + " announced twice";
  }
  if (why.empty() &&
      (peerSlabs_.size() >= kMaxSlabs ||
       capacity > kMaxPeerSlabBytes - peerSlabBytes_)) {
    why = "the peer's slabs exceed " + std::to_string(kMaxSlabs) +
        " or " + std::to_string(kMaxPeerSlabBytes) + " bytes";
  }
  if (!why.empty()) {
    rejectFromLoop("rejected slab: " + why);
    return false;
  }
  peerSlabBytes_ += capacity;
  peerSlabs_.emplace(id, std::move(slab));
  return true;
}

bool ShmConnection::onSlabReleaseFromLoop() {
  uint32_t unheld = 0;
  bool ok = true;
  {
    std::lock_guard<std::mutex> lock(slabMutex_);
    auto now = std::chrono::steady_clock::now();
    for (size_t at = 0; ok && at < head_.size(); at += sizeof(uint32_t)) {
      uint32_t id;
      std::memcpy(&id, head_.data() + at, sizeof(id));
      auto it = ownSlabs_.find(id);
      if (it == ownSlabs_.end() || it->second.state != OwnSlab::State::kLent) {
        ok = false;
        unheld = id;
        break;
      }
      it->second.state = OwnSlab::State::kFree;
      it->second.lastUsed = now;
      lentSlabBytes_ -= it->second.slab->capacity();
    }
  }
  if (!ok) {
    // No risk to us, but a peer that loses track of its leases is broken.
    rejectFromLoop(
        "rejected frame: the peer released slab " + std::to_string(unheld) +
        ", which it does not hold");
    return false;
  }
  trimSlabs();
  return state_ != State::kClosed;
}

bool ShmConnection::onSlabDropFromLoop() {
  uint32_t id;
  std::memcpy(&id, head_.data(), sizeof(id));
  auto it = peerSlabs_.find(id);
  if (it == peerSlabs_.end()) {
    rejectFromLoop(
        "rejected frame: the peer dropped slab " + std::to_string(id) +
        ", which it never announced");
    return false;
  }
  // Leases of ours (there should be none) keep their own mapping.
  peerSlabBytes_ -= it->second->capacity();
  peerSlabs_.erase(it);
  return true;
}

int64_t ShmConnection::onSlabRecordFromLoop(const SlabRecord& r) {
  uint64_t size = segmentSizes_[segmentIndex_];
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
      lentSlabBytes_ -= slab->capacity();
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
    rejectFromLoop("rejected frame: " + why);
    return -1;
  }
  size_t i = segmentIndex_;
  inbound_.provided[i] = slab->data() + r.offset;
  inbound_.regions[i] = std::make_shared<SlabLease>(
      std::static_pointer_cast<ShmConnection>(shared_from_this()), this,
      std::move(slab), r.id, own);
  return static_cast<int64_t>(size);
}

} // namespace torch_rpc_ext::transport::shm
