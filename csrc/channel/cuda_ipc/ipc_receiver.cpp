// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc's receiving side (ipc_channel.h): the peer's block setups,
// releases and drops, and the records that make a received segment a view
// of a block (or, for a legacy block, a copy out of it).
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/channel/cuda_ipc/ipc_lease.h"
#include "csrc/common/fd_closer.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

using frame::FrameKind;
using frame::SegmentRecord;

bool IpcChannel::reaches(int target, int device) {
  const auto key = std::make_pair(target, device);
  auto it = reach_.find(key);
  if (it == reach_.end()) {
    bool can = false;
    try {
      can = canAccessPeer(target, device);
    } catch (const std::exception&) {
      // (a device index the driver refuses: no)
    }
    it = reach_.emplace(key, can).first;
  }
  return it->second;
}

// The peer may have at most this many bytes of blocks mapped into us.
constexpr uint64_t kMaxPeerBlockBytes = 2 * kMaxLentBlockBytes;
// A refusal's reason (kBlockDropped sent unasked) is cut to this.
constexpr size_t kMaxRefusalWhy = 1024;

// The peer's text as our log shows it: printable ASCII, the rest '?'.
std::string printable(std::string text) {
  for (char& c : text) {
    if (c < 0x20 || c > 0x7e) {
      c = '?';
    }
  }
  return text;
}

bool IpcChannel::acceptsControlFrame(FrameKind kind, uint32_t headLength)
    const {
  switch (context().wireIds().offsetOf(kind)) {
    case kBlockDropped: // the id, and why where it was refused
      return headLength >= sizeof(uint32_t) &&
          headLength <= sizeof(uint32_t) + kMaxRefusalWhy;
    case kGrant:
      return headLength == sizeof(GrantSetup);
    case kGrantEvent:
      return headLength == sizeof(GrantEventSetup);
    case kGrantRevoke:
    case kGrantReturned:
      return headLength >= sizeof(uint32_t) && headLength <= kMaxReleaseHead &&
          headLength % sizeof(uint32_t) == 0;
    default:
      break;
  }
  // A setup's head is one of two sizes (kFd, kLegacy): onSetupFromLoop()
  // checks which its `sharing` says.
  return lendingFrameFits(
             context().wireIds(), kind, headLength, sizeof(BlockSetup)) ||
      lendingFrameFits(
             context().wireIds(), kind, headLength, kLegacySetupBytes);
}

bool IpcChannel::onControlFrameFromLoop(
    FrameKind kind,
    const std::string& head,
    std::vector<int>& fds) {
  auto host = host_.lock();
  if (!host) {
    return false;
  }
  switch (context().wireIds().offsetOf(kind)) {
    case kBlockSetup:
      return onSetupFromLoop(*host, head, fds);
    case kBlockRelease:
      return onReleaseFromLoop(*host, head);
    case kBlockDrop:
      return onDropFromLoop(*host, head);
    case kBlockDropped:
      return onDroppedFromLoop(*host, head);
    case kGrant:
      return onGrantFromLoop(*host, head);
    case kGrantEvent:
      return onGrantEventFromLoop(*host, head);
    case kGrantRevoke:
      onGrantRevokeFromLoop(head);
      return true;
    case kGrantReturned:
      return onGrantReturnedFromLoop(*host, head);
    default:
      return true;
  }
}

bool IpcChannel::onSetupFromLoop(
    Host& host,
    const std::string& head,
    std::vector<int>& fds) {
  BlockSetup setup;
  std::memcpy(&setup, head.data(), sizeof(setup));
  const auto sharing = static_cast<Sharing>(setup.sharing);
  const bool legacy = sharing == Sharing::kLegacy;
  if (sharing != Sharing::kFd && !legacy) {
    host.rejectFromLoop(
        "rejected frame: CUDA block setup of unknown sharing " +
        std::to_string(setup.sharing));
    return false;
  }
  if (head.size() != (legacy ? kLegacySetupBytes : sizeof(BlockSetup))) {
    host.rejectFromLoop(
        "rejected frame: CUDA block setup of " + std::to_string(head.size()) +
        " bytes for its sharing");
    return false;
  }
  CUipcMemHandle handle{};
  int fd = -1;
  if (legacy) {
    std::memcpy(&handle, head.data() + sizeof(setup), sizeof(handle));
  } else if (fds.empty()) {
    host.rejectFromLoop(
        "rejected frame: CUDA block setup without its "
        "descriptor");
    return false;
  } else {
    fd = fds.front();
    fds.erase(fds.begin());
  }
  std::string uuid(setup.deviceUuid, sizeof(setup.deviceUuid));
  std::string why;
  auto device = localDevices_.find(uuid);
  if (device == localDevices_.end()) {
    why = "block " + std::to_string(setup.id) + " is on device " + uuid +
        ", which this process does not see";
  } else if (
      peerBlocks_.count(setup.id) != 0 || refusedBlocks_.count(setup.id) != 0) {
    why = "block " + std::to_string(setup.id) + " announced twice";
  } else if (
      peerBlocks_.size() + refusedBlocks_.size() >= kMaxBlocks ||
      setup.size > kMaxPeerBlockBytes - peerBlockBytes_) {
    why = "the peer's blocks exceed " + std::to_string(kMaxBlocks) + " or " +
        std::to_string(kMaxPeerBlockBytes) + " bytes";
  }
  std::shared_ptr<Block> block;
  std::string unmapped;
  if (why.empty()) {
    try {
      block =
          Block::import(setup, fd, legacy ? &handle : nullptr, device->second);
    } catch (const CudaError& e) {
      unmapped = e.what(); // our driver's answer: refused, below
    } catch (const std::exception& e) {
      // The peer's word does not hold (a size off the granularity, or
      // larger than the allocation its handle opens).
      why = std::string("cannot map the peer's CUDA block: ") + e.what();
    }
  }
  closeOffThread(fd); // the peer's (fd_closer.h)
  if (!why.empty()) {
    host.rejectFromLoop("rejected CUDA block: " + why);
    return false;
  }
  if (block == nullptr) {
    // Our driver would not map it (out of memory or address space, an
    // environment that shares no device memory, a handle that does not
    // open): the messages in it fail, the connection stays, and the owner
    // hears why (kBlockDropped, unasked) and lends no more blocks here: its
    // segments take the next channel (docs/cuda.md, "A block the peer
    // cannot map").
    std::string reason = "this process could not map the peer's CUDA block " +
        std::to_string(setup.id) + " of " + std::to_string(setup.size) +
        " bytes on cuda:" + std::to_string(device->second) + ": " + unmapped;
    if (reason.size() > kMaxRefusalWhy) {
      reason.resize(kMaxRefusalWhy);
    }
    counters_.blocksRefused.fetch_add(1, std::memory_order_relaxed);
    host.sendControl(
        ControlFrame{
            context().wireIds().kind(kBlockDropped),
            idHead(setup.id) + reason,
            {},
            nullptr});
    refusedBlocks_.emplace(setup.id, std::move(reason));
    return true;
  }
  counters_.imported.fetch_add(1, std::memory_order_relaxed);
  peerBlockBytes_ += setup.size;
  peerBlocks_.emplace(setup.id, std::move(block));
  return true;
}

bool IpcChannel::onReleaseFromLoop(Host& host, const std::string& head) {
  uint32_t unheld = 0;
  bool ok = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto now = std::chrono::steady_clock::now();
    for (uint32_t id : idsOf(head)) {
      auto it = ownBlocks_.find(id);
      if (it == ownBlocks_.end() ||
          it->second.state != OwnBlock::State::kLent) {
        ok = false;
        unheld = id;
        break;
      }
      it->second.state = OwnBlock::State::kFree;
      it->second.lastUsed = now;
      it->second.peerUsed = true;
      lentBytes_ -= it->second.block->size();
    }
  }
  if (!ok) {
    host.rejectFromLoop(
        "rejected frame: the peer released CUDA block " +
        std::to_string(unheld) + ", which it does not hold");
    return false;
  }
  return true;
}

bool IpcChannel::onDropFromLoop(Host& host, const std::string& head) {
  uint32_t id;
  std::memcpy(&id, head.data(), sizeof(id));
  if (refusedBlocks_.erase(id) != 0) {
    // Dropped (idle) before our refusal reached the owner: that refusal is
    // its answer, and it holds nothing of ours.
    return true;
  }
  auto it = peerBlocks_.find(id);
  if (it == peerBlocks_.end()) {
    host.rejectFromLoop(
        "rejected frame: the peer dropped CUDA block " + std::to_string(id) +
        ", which it never announced");
    return false;
  }
  peerBlockBytes_ -= it->second->size();
  // Closed once no lease or copy out holds it any more (the owner drops
  // only blocks we released, so that is at once but for a misbehaving
  // peer), then answered: the owner frees it only after.
  peerDropped_.emplace_back(id, std::move(it->second));
  peerBlocks_.erase(it);
  peerLeases_.erase(id);
  closeDropped();
  return true;
}

void IpcChannel::closeDropped() {
  for (auto it = peerDropped_.begin(); it != peerDropped_.end();) {
    if (it->second.use_count() > 1) {
      ++it;
      continue;
    }
    const uint32_t id = it->first;
    // The staging thread unmaps the memory (cuIpcCloseMemHandle for a
    // legacy block) and destroys the opened events once our last use of
    // them is done (block.h): only then does the owner hear, and free it.
    it->second->whenFreed(
        [weak = host_, kind = context().wireIds().kind(kBlockDropped), id] {
          if (auto h = weak.lock()) {
            h->sendControl(ControlFrame{kind, idHead(id), {}, nullptr});
          }
        });
    it = peerDropped_.erase(it);
  }
}

bool IpcChannel::onDroppedFromLoop(Host& host, const std::string& head) {
  uint32_t id;
  std::memcpy(&id, head.data(), sizeof(id));
  // With a reason: the peer could not map the block at all (it answers its
  // setup, in whatever state the block is here: lent, for the frame it
  // came with). It holds nothing of it, so it goes at once.
  const bool refused = head.size() > sizeof(id);
  std::shared_ptr<Block> block; // freed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ownBlocks_.find(id);
    if (it != ownBlocks_.end() &&
        (refused ? !it->second.peerUsed
                 : it->second.state == OwnBlock::State::kDropping)) {
      if (it->second.state == OwnBlock::State::kLent) {
        lentBytes_ -= it->second.block->size();
      }
      block = std::move(it->second.block);
      ownBlocks_.erase(it);
    }
  }
  if (block == nullptr) {
    host.rejectFromLoop(
        "rejected frame: the peer closed CUDA block " + std::to_string(id) +
        (refused ? ", which it never had or has used"
                 : ", which was not dropped"));
    return false;
  }
  if (!refused) {
    counters_.unmapped.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  if (!lendingRefused_.exchange(true)) {
    counters_.lendingRefused.fetch_add(1, std::memory_order_relaxed);
    logWarning(
        "torch_rpc_ext: cuda_ipc: the peer could not map a CUDA block of "
        "ours, so this connection lends it no more (its CUDA tensors go by "
        "the next device channel, cuda_ring or cuda_staged, where both "
        "ends have one): " +
        printable(head.substr(sizeof(id))));
  }
  return true;
}

int64_t IpcChannel::onRecordFromLoop(
    const SegmentRecord& record,
    InboundSegment& segment) {
  BlockRecord r;
  std::memcpy(&r, &record, sizeof(r));
  if (r.kind == BlockRecord::kGranted) {
    return onGrantedFromLoop(r, segment);
  }
  auto fits = [&](const Block& b) {
    return r.offset <= b.size() && segment.size <= b.size() - r.offset;
  };
  std::shared_ptr<Block> block;
  const bool own = r.kind == BlockRecord::kReturned;
  const bool copyOut =
      r.kind == BlockRecord::kCopyOut || r.kind == BlockRecord::kCopyOutLast;
  std::string why;
  if (r.kind == BlockRecord::kLent || copyOut) {
    auto it = peerBlocks_.find(r.id);
    if (auto refused = refusedBlocks_.find(r.id);
        it == peerBlocks_.end() && refused != refusedBlocks_.end()) {
      // Its message fails (the agent's LandingFailure), naming why.
      *segment.provided = nullptr;
      *segment.region = std::make_shared<frame::FailedRegion>(refused->second);
      return static_cast<int64_t>(segment.size);
    }
    if (it == peerBlocks_.end()) {
      why = "record names unknown CUDA block " + std::to_string(r.id);
    } else if ((it->second->sharing() == Sharing::kLegacy) != copyOut) {
      // A legacy block dies with its owner: it is never viewed, and a
      // descriptor's block is never copied out of.
      why = "record kind " + std::to_string(r.kind) + " for CUDA block " +
          std::to_string(r.id) + " of the other sharing";
    } else {
      block = it->second;
    }
  } else if (own) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ownBlocks_.find(r.id);
    if (it == ownBlocks_.end() || it->second.state != OwnBlock::State::kLent) {
      why = "the peer handed back CUDA block " + std::to_string(r.id) +
          ", which it does not hold";
    } else if (it->second.block->sharing() == Sharing::kLegacy) {
      // Never viewed by the peer, so never handed back.
      why = "the peer handed back legacy CUDA block " + std::to_string(r.id);
    } else if (fits(*it->second.block)) {
      block = it->second.block;
      it->second.state = OwnBlock::State::kLocal;
      it->second.peerUsed = true;
      lentBytes_ -= block->size();
    }
  } else {
    why = "unknown CUDA block record kind " + std::to_string(r.kind);
  }
  if (why.empty() && (block == nullptr || !fits(*block))) {
    why = "segment of " + std::to_string(segment.size) + " bytes at offset " +
        std::to_string(r.offset) + " overruns CUDA block " +
        std::to_string(r.id);
  }
  if (!why.empty()) {
    if (auto host = host_.lock()) {
      host->rejectFromLoop("rejected frame: " + why);
    }
    return -1;
  }
  // A large segment of the peer's on the device it lands on: the next may
  // go into a grant (ipc_grants.cpp).
  // (Not one for a device we do not serve: the message fails, and a grant
  // for it would go unused.)
  if (!own && segment.device != frame::kDeviceNotServed &&
      (segment.device < 0 || segment.device == block->device())) {
    noteLargeFromLoop(block->device(), segment.size);
  }
  if (copyOut) {
    return copyOutFromLoop(r, block, segment);
  }
  // A tensor for another device of ours than the block's: read peer to
  // peer, where that device reaches the block's (the sender's map, which
  // our descriptor allowed: IpcDomain::Device::peers).
  const int target = segment.device >= 0 ? segment.device : block->device();
  std::shared_ptr<CUstream_st> join;
  if (!own && target != block->device()) {
    std::string no;
    if (block->sharing() != Sharing::kFd || !reaches(target, block->device())) {
      no = "cuda:" + std::to_string(target) +
          " cannot read memory of cuda:" + std::to_string(block->device()) +
          " peer to peer";
    } else {
      try {
        block->grantAccess(target);
        join = joinStream(block->device());
      } catch (const std::exception& e) {
        no = e.what();
      }
    }
    if (!no.empty()) {
      if (auto host = host_.lock()) {
        host->rejectFromLoop(
            "rejected frame: a tensor for cuda:" + std::to_string(target) +
            " in CUDA block " + std::to_string(r.id) + ": " + no);
      }
      return -1;
    }
  }
  *segment.provided = reinterpret_cast<void*>(block->address() + r.offset);
  if (!own) {
    // A block the peer lends again only once our lease on it died or was
    // handed back: a live one that was not is this frame's, whose segments
    // share it (and go to one device: the sender's map is per device).
    auto& live = peerLeases_[r.id];
    if (auto lease = live.lock(); lease && !lease->handedOn()) {
      if (lease->device() != target) {
        if (auto host = host_.lock()) {
          host->rejectFromLoop(
              "rejected frame: CUDA block " + std::to_string(r.id) +
              " holds tensors for two devices");
        }
        return -1;
      }
      lease->share();
      *segment.region = std::move(lease);
      return static_cast<int64_t>(segment.size);
    }
    if (!join) {
      // Where a lease dies with no use to join, its release is recorded
      // there after the peer's last copy into the block (~BlockLease).
      join = joinStream(block->device());
    }
    auto lease = std::make_shared<BlockLease>(
        weak_from_this(), std::move(block), r.id, own, target, join);
    live = lease;
    *segment.region = std::move(lease);
    return static_cast<int64_t>(segment.size);
  }
  *segment.region = std::make_shared<BlockLease>(
      weak_from_this(), std::move(block), r.id, own);
  return static_cast<int64_t>(segment.size);
}

int64_t IpcChannel::copyOutFromLoop(
    const BlockRecord& r,
    const std::shared_ptr<Block>& block,
    InboundSegment& segment) {
  const bool last = r.kind == BlockRecord::kCopyOutLast;
  const int device = block->device();
  try {
    StagingPool& pool = StagingPool::of(device);
    const std::shared_ptr<CUstream_st> owned = copyOutStream(device);
    const CUstream stream = owned.get();
    CopyOut& batch = copyOuts_[r.id];
    if (batch.copies.size() >= kMaxCopyOutBatch) {
      throw std::runtime_error(
          "over " + std::to_string(kMaxCopyOutBatch) +
          " segments in it without its last");
    }
    if (!batch.ready) {
      batch.block = block;
      batch.ready = pool.takeEvent();
    }
    std::shared_ptr<StagingPool::Block> landed;
    try {
      landed = pool.takeBlock(segment.size);
    } catch (const std::exception& e) {
      // Our device memory, not the peer's doing: this message fails (its
      // call, in the agent), the connection stays (docs/cuda.md, "A
      // message that cannot land fails its call, not the connection"). The
      // block's other segments are still copied out, and it is released
      // as ever.
      *segment.provided = nullptr;
      *segment.region = std::make_shared<frame::FailedRegion>(
          "no memory on cuda:" + std::to_string(device) +
          " to copy a segment of " + std::to_string(segment.size) +
          " bytes out of the peer's CUDA block into: " + e.what());
      counters_.copyOutsFailed.fetch_add(1, std::memory_order_relaxed);
    }
    CurrentDevice current(device);
    if (landed) {
      const CUdeviceptr address = landed->address;
      const bool used = landed->used;
      const CUevent lastUse = landed->lastUse;
      // From here the region gives the block back, whatever follows.
      *segment.region = std::make_shared<PooledRegion>(
          pool, std::move(landed), batch.ready, owned);
      *segment.provided = reinterpret_cast<void*>(address);
      if (used) {
        // The block's last user must be done before the copy overwrites
        // it.
        TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, lastUse, 0);
      }
      batch.copies.push_back(
          {address, block->address() + r.offset, segment.size});
    }
    if (last) {
      // One launch for the frame's segments in the block, after the peer's
      // copy in; the owner's next copy into it waits for ours (`released`:
      // after its copy in, even where nothing of it was copied out).
      TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, block->ready(), 0);
      try {
        if (!batch.copies.empty()) {
          copyEngine(device).copySegments(stream, batch.copies);
        }
      } catch (...) {
        // A launch may have been queued before the error: the import is
        // unmapped only after it, whatever follows (best effort).
        libcuda().cuEventRecord(block->localUse(), stream);
        throw;
      }
      // Our last read of the peer's memory, for the block's teardown
      // (recorded first: nothing may fail between the copy and it).
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block->localUse(), stream);
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, batch.ready.get(), stream);
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block->released(), stream);
      counters_.copiedOut.fetch_add(
          batch.copies.size(), std::memory_order_relaxed);
      copyOuts_.erase(r.id);
    }
  } catch (const std::exception& e) {
    copyOuts_.erase(r.id);
    if (auto host = host_.lock()) {
      host->rejectFromLoop(
          "cuda_ipc: copying segments out of the peer's CUDA block " +
          std::to_string(r.id) + " failed: " + e.what());
    }
    return -1;
  }
  if (last) {
    releasePeerBlock(r.id, block->size());
  }
  return static_cast<int64_t>(segment.size);
}

} // namespace torch_rpc_ext::channel::cuda
