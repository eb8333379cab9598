// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc's grants (ipc_channel.h; docs/cuda.md, "Grants"), the receiver's
// side (the sender's: ipc_grant_writes.cpp): landing memory
// of the receiver's (a block of its landing pool, torch's memory) that the
// sender writes a large segment straight into, so that the segment crosses
// with one device copy and the receiver's tensor is that memory.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/device_memory.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/channel/cuda/staging_thread.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/channel/lending.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"
#include "csrc/frame/landed_region.h"

namespace torch_rpc_ext::channel::cuda {

using frame::SegmentRecord;

namespace {

// A segment the peer wrote into our grant: the grant's memory, ready for
// work queued after waitOn(). `written` is an event of ours, recorded on the
// connection's join stream after it waited on the peer's grant event as the
// record arrived: the peer records that event again for its next grant's
// copy (maybe on another stream), which the next grant allows, so its
// record of this copy is captured before that grant can exist.
class GrantedRegion final : public frame::LandedRegion {
 public:
  GrantedRegion(
      int device,
      std::unique_ptr<frame::LandedMemory> memory,
      PooledEvent written)
      : device_(device),
        memory_(std::move(memory)),
        written_(std::move(written)) {}
  ~GrantedRegion() override {
    if (memory_ == nullptr) {
      return;
    }
    // Never taken (its message failed): back to the pool only once the
    // peer's copy into it completed, found by the staging thread. (Not by
    // a wait queued on the grant stream: every connection's grants of the
    // device are recorded free there, so a copy that never completes, its
    // peer gone, would hold back every later grant, and with them the
    // streams of every peer writing into one. This way only its memory is
    // kept, until the process exits.)
    std::shared_ptr<frame::LandedMemory> memory = std::move(memory_);
    whenComplete(device_, std::move(written_), [memory](const std::string&) {
      // (An event that failed: its context's work is over too.)
    });
  }
  int device() const override {
    return device_;
  }
  void waitOn(uintptr_t stream) override {
    CurrentDevice current(device_);
    TORCH_RPC_EXT_CUDA_CHECK(
        cuStreamWaitEvent,
        reinterpret_cast<CUstream>(stream),
        written_.get(),
        0);
  }
  std::unique_ptr<frame::LandedMemory> take() override {
    return std::move(memory_);
  }

 private:
  const int device_;
  std::unique_ptr<frame::LandedMemory> memory_;
  PooledEvent written_;
};

// Grants are made in multiples of this (as torch rounds large blocks).
constexpr uint64_t kGrantRound = uint64_t(2) << 20;
static_assert(
    kGrantRound <= kGrantMinBytes * kGrantSlack,
    "a rounded grant fits the segment it was made for");

// Rounded up, so that sizes a little apart share one (at most twice the
// segment still: it is over 1 MiB).
uint64_t roundGrant(uint64_t bytes) {
  return (bytes + kGrantRound - 1) / kGrantRound * kGrantRound;
}

} // namespace

void IpcChannel::noteLargeFromLoop(int device, uint64_t size) {
  if (grantsPossible_ && size > kGrantMinBytes) {
    auto& noted = noted_[device];
    noted.insert(size);
    if (noted.size() > kGrantSlots) {
      noted.erase(noted.begin()); // the largest few
    }
  }
}

void IpcChannel::postGrantsFromLoop() {
  if (noted_.empty()) {
    return;
  }
  std::map<int, std::set<uint64_t>> noted;
  noted.swap(noted_);
  auto source = grantSource();
  if (source == nullptr) {
    return;
  }
  bool revoked = false;
  for (const auto& [device, sizes] : noted) {
    for (auto it = sizes.rbegin(); it != sizes.rend(); ++it) {
      revoked = postGrantFromLoop(source, device, *it) || revoked;
    }
  }
  if (revoked) {
    flushReleases(); // rare (a new size): not held for a ride
  }
}

bool IpcChannel::postGrantFromLoop(
    const std::shared_ptr<GrantSource>& source,
    int device,
    uint64_t bytes) {
  // (Only this thread adds or ends grants: what it reads here holds until
  // it allocates.)
  int slot = -1;
  OutGrant unsent; // (freed outside the lock)
  const uint64_t rounded = roundGrant(bytes);
  {
    std::lock_guard<std::mutex> lock(grantMu_);
    grantSource_ = source;
    std::set<int> taken;
    auto oldest = outGrants_.end();
    auto idle = outGrants_.end(); // taken back as idle: nothing follows it
    for (auto it = outGrants_.begin(); it != outGrants_.end(); ++it) {
      OutGrant& g = it->second;
      if (g.device != device) {
        continue;
      }
      if (grantFits(g.revoking ? g.wanted : g.bytes, bytes)) {
        return false; // one out serves it (or will, once back)
      }
      taken.insert(g.slot);
      if (g.revoking && g.wanted == 0 && idle == outGrants_.end()) {
        idle = it;
      }
      if (!g.revoking && oldest == outGrants_.end()) {
        oldest = it; // (ids ascend: the first is the oldest)
      }
    }
    for (int i = 0; i < static_cast<int>(kGrantSlots); ++i) {
      if (taken.count(i) == 0) {
        slot = i;
        break;
      }
    }
    if (slot < 0) {
      // Every slot taken: a slot on its way back for idleness takes this
      // size after its return; else the oldest grant makes room. One the
      // peer has is taken back, and this size follows its return; one not
      // yet sent is replaced now. None where the bound would not have room
      // for this size even with that grant's bytes back: revoking it would
      // end a grant in use for nothing, over and over.
      auto making = idle != outGrants_.end() ? idle : oldest;
      if (making == outGrants_.end()) {
        return false; // all on their way back
      }
      OutGrant& g = making->second;
      if (!grantRoom(device, rounded, g.bytes)) {
        counters_.grantsOverLimit.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
      if (making == idle) {
        g.wanted = bytes;
        return false;
      }
      if (g.sent) {
        g.revoking = true;
        g.wanted = bytes;
        pendingRevokes_ += idHead(making->first);
        counters_.grantsRevoked.fetch_add(1, std::memory_order_relaxed);
        return true;
      }
      slot = g.slot;
      unsent = std::move(g);
      outGrants_.erase(making);
    }
  }
  unsent.claim.reset(); // the pool's and the bound's again, for this one
  unsent.memory.memory.reset();
  OutGrant g;
  g.device = device;
  g.slot = slot;
  g.bytes = rounded;
  if (!reserveGrant(device, g.bytes)) {
    // Past cuda_ipc_memory_limit with our blocks and grants out: the
    // segments land by copy (an idle grant's end makes room).
    counters_.grantsOverLimit.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  g.claim = GrantClaim(device, g.bytes);
  try {
    g.memory = source->allocate(device, g.bytes);
    std::unique_lock<std::mutex> lock(grantMu_);
    if (sharedSegments_.count(g.memory.segmentKey) == 0 &&
        sharedSegments_.size() >= kMaxPeerSegments) {
      // The peer keeps at most that many of our segments open (and
      // closes a connection that names more): none in a new one.
      lock.unlock();
      g.memory.memory.reset();
      counters_.grantsCapped.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    // The peer may have it open from now on (counted before the grant
    // goes, so that the cap above holds across devices).
    if (sharedSegments_.insert(g.memory.segmentKey).second) {
      source->segmentShared(g.memory.segmentKey);
    }
    CurrentDevice current(device);
    auto free = freeEvents_.find({device, slot});
    if (free == freeEvents_.end()) {
      // One per device and slot, interprocess: the peer opens it once.
      // Recorded again only for the slot's next grant, which follows the
      // end of this one: the peer queued its wait before its copy.
      CUevent e = nullptr;
      CUipcEventHandle handle;
      TORCH_RPC_EXT_CUDA_CHECK(
          cuEventCreate, &e, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
      if (libcuda().cuIpcGetEventHandle(&handle, e) != CUDA_SUCCESS) {
        libcuda().cuEventDestroy(e);
        throw std::runtime_error("no interprocess handle for an event");
      }
      free =
          freeEvents_.emplace(SlotKey{device, slot}, std::make_pair(e, handle))
              .first;
    }
    // The block's last use before the grant (a freed tensor's, on the
    // grant stream) is what the peer's copy waits for.
    TORCH_RPC_EXT_CUDA_CHECK(
        cuEventRecord, free->second.first, g.memory.stream);
  } catch (const std::exception& e) {
    logWarningLimited(
        "cuda_ipc_grant",
        std::string(
            "torch_rpc_ext: cuda_ipc could not grant landing "
            "memory (the segment lands by copy): ") +
            e.what());
    return false;
  }
  std::lock_guard<std::mutex> lock(grantMu_);
  outGrants_.emplace(nextGrantId_++, std::move(g));
  counters_.grantsMade.fetch_add(1, std::memory_order_relaxed);
  return false;
}

void IpcChannel::collectGrantsLocked(std::vector<ControlFrame>* out) {
  std::vector<OutGrant> dropped; // freed after the lock (the bound's lock)
  std::vector<uint32_t> failed;
  std::lock_guard<std::mutex> lock(grantMu_);
  for (auto [kind, ids] :
       {std::make_pair(kGrantRevoke, &pendingRevokes_),
        std::make_pair(kGrantReturned, &pendingReturns_)}) {
    if (!ids->empty()) {
      out->push_back(
          ControlFrame{
              context().wireIds().kind(kind), std::move(*ids), {}, {}});
      ids->clear();
    }
  }
  for (auto& [id, g] : outGrants_) {
    if (g.sent) {
      continue;
    }
    GrantSetup setup{};
    setup.free = freeEvents_.at({g.device, g.slot}).second;
    setup.id = id;
    setup.device = static_cast<uint32_t>(g.device);
    setup.slot = static_cast<uint32_t>(g.slot);
    setup.bytes = g.bytes;
    setup.offset = reinterpret_cast<uintptr_t>(g.memory.memory->data()) -
        g.memory.segmentBase;
    setup.segmentKey = g.memory.segmentKey;
    setup.segmentSize = g.memory.segmentSize;
    try {
      CurrentDevice current(g.device);
      TORCH_RPC_EXT_CUDA_CHECK(
          cuIpcGetMemHandle, &setup.segment, g.memory.segmentBase);
    } catch (const std::exception& e) {
      logWarningLimited(
          "cuda_ipc_grant_handle",
          std::string("torch_rpc_ext: cuda_ipc could not share a grant: ") +
              e.what());
      // Dropped, its memory and its share of the bound given back: held
      // unsent, it would block any other grant of its size until the close
      // (the idle revoke takes back only grants the peer has). The peer
      // never saw it, so nothing else names it.
      failed.push_back(id);
      continue;
    }
    out->push_back(
        ControlFrame{
            context().wireIds().kind(kGrant),
            std::string(reinterpret_cast<const char*>(&setup), sizeof(setup)),
            {},
            {}});
    g.sent = true;
    g.sentAt = std::chrono::steady_clock::now();
  }
  for (uint32_t id : failed) {
    dropped.push_back(std::move(outGrants_.extract(id).mapped()));
  }
}

bool IpcChannel::onGrantEventFromLoop(Host& host, const std::string& head) {
  GrantEventSetup setup;
  std::memcpy(&setup, head.data(), sizeof(setup));
  if (setup.device >= static_cast<uint32_t>(deviceCount()) ||
      setup.slot >= kGrantSlots) {
    host.rejectFromLoop(
        "rejected frame: a CUDA grant event for no device or slot");
    return false;
  }
  const int device = static_cast<int>(setup.device);
  CUevent e = nullptr;
  try {
    CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuIpcOpenEventHandle, &e, setup.event);
  } catch (const std::exception& ex) {
    host.rejectFromLoop(
        std::string(
            "rejected frame: a CUDA grant event that does not "
            "open: ") +
        ex.what());
    return false;
  }
  peerGrantEvents_[{device, static_cast<int>(setup.slot)}] =
      std::shared_ptr<CUevent_st>(e, [device](CUevent e) {
        try {
          CurrentDevice current(device);
          libcuda().cuEventDestroy(e);
        } catch (...) {
        }
      });
  return true;
}

int64_t IpcChannel::onGrantedFromLoop(
    const BlockRecord& r,
    InboundSegment& segment) {
  std::string why;
  int device = -1;
  int slot = 0;
  {
    std::lock_guard<std::mutex> lock(grantMu_);
    auto it = outGrants_.find(r.id);
    if (it == outGrants_.end() || !it->second.sent) {
      why = "a record names CUDA grant " + std::to_string(r.id) +
          ", which is not out";
    } else if (
        r.offset != 0 || segment.size > it->second.bytes ||
        (segment.device >= 0 && segment.device != it->second.device)) {
      why = "a segment of " + std::to_string(segment.size) +
          " bytes does not fit CUDA grant " + std::to_string(r.id);
    } else {
      device = it->second.device;
      slot = it->second.slot;
    }
  }
  auto peerWritten = peerGrantEvents_.find({device, slot});
  if (why.empty() && peerWritten == peerGrantEvents_.end()) {
    why = "a record of CUDA grant " + std::to_string(r.id) +
        " before the peer's grant event";
  }
  PooledEvent written;
  if (why.empty()) {
    // The peer's record of this copy, captured now (GrantedRegion).
    try {
      written = StagingPool::of(device).takeEvent();
      auto join = joinStream(device);
      CurrentDevice current(device);
      TORCH_RPC_EXT_CUDA_CHECK(
          cuStreamWaitEvent, join.get(), peerWritten->second.get(), 0);
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, written.get(), join.get());
    } catch (const std::exception& e) {
      why = std::string("the wait on CUDA grant ") + std::to_string(r.id) +
          " could not be queued: " + e.what();
    }
  }
  if (!why.empty()) {
    // (A grant the record named stays out: the close holds it.)
    if (auto host = host_.lock()) {
      host->rejectFromLoop("rejected frame: " + why);
    }
    return -1;
  }
  OutGrant g;
  {
    std::lock_guard<std::mutex> lock(grantMu_);
    auto it = outGrants_.find(r.id);
    g = std::move(it->second);
    outGrants_.erase(it);
  }
  counters_.segments.fetch_add(1, std::memory_order_relaxed);
  // Its slot's next grant, as large (the segment fitted it), and the size
  // a revoke of it asked for.
  noteLargeFromLoop(g.device, g.bytes);
  if (g.revoking) {
    noteLargeFromLoop(g.device, g.wanted);
  }
  *segment.provided = g.memory.memory->data();
  *segment.region = std::make_shared<GrantedRegion>(
      g.device, std::move(g.memory.memory), written);
  return static_cast<int64_t>(segment.size);
}

} // namespace torch_rpc_ext::channel::cuda
