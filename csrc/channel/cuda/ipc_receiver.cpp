// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc's receiving side (ipc_channel.h): the peer's block setups,
// releases and drops, and the records that make a received segment a view
// of a block.
#include <unistd.h>

#include <cstring>
#include <string>

#include "csrc/channel/cuda/ipc_channel.h"
#include "csrc/channel/cuda/ipc_lease.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::channel::cuda {

using frame::FrameKind;
using frame::SegmentRecord;

// The peer may have at most this many bytes of blocks mapped into us.
constexpr uint64_t kMaxPeerBlockBytes = 2 * kMaxLentBlockBytes;

bool IpcChannel::acceptsControlFrame(FrameKind kind, uint32_t headLength)
    const {
  return lendingFrameFits(
      context().wireIds(), kind, headLength, sizeof(BlockSetup));
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
    default:
      return true;
  }
}

bool IpcChannel::onSetupFromLoop(
    Host& host,
    const std::string& head,
    std::vector<int>& fds) {
  if (fds.empty()) {
    host.rejectFromLoop(
        "rejected frame: CUDA block setup without its "
        "descriptor");
    return false;
  }
  int fd = fds.front();
  fds.erase(fds.begin());
  BlockSetup setup;
  std::memcpy(&setup, head.data(), sizeof(setup));
  std::string uuid(setup.deviceUuid, sizeof(setup.deviceUuid));
  std::string why;
  auto device = localDevices_.find(uuid);
  if (device == localDevices_.end()) {
    why = "block " + std::to_string(setup.id) + " is on device " + uuid +
        ", which this process does not see";
  } else if (peerBlocks_.count(setup.id) != 0) {
    why = "block " + std::to_string(setup.id) + " announced twice";
  } else if (
      peerBlocks_.size() >= kMaxBlocks ||
      setup.size > kMaxPeerBlockBytes - peerBlockBytes_) {
    why = "the peer's blocks exceed " + std::to_string(kMaxBlocks) + " or " +
        std::to_string(kMaxPeerBlockBytes) + " bytes";
  }
  std::shared_ptr<Block> block;
  if (why.empty()) {
    try {
      block = Block::import(setup, fd, device->second);
    } catch (const std::exception& e) {
      why = std::string("cannot map the peer's CUDA block: ") + e.what();
    }
  }
  ::close(fd);
  if (!why.empty()) {
    host.rejectFromLoop("rejected CUDA block: " + why);
    return false;
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
  auto it = peerBlocks_.find(id);
  if (it == peerBlocks_.end()) {
    host.rejectFromLoop(
        "rejected frame: the peer dropped CUDA block " + std::to_string(id) +
        ", which it never announced");
    return false;
  }
  peerBlockBytes_ -= it->second->size();
  peerBlocks_.erase(it); // leases keep their own reference
  peerLeases_.erase(id);
  return true;
}

int64_t IpcChannel::onRecordFromLoop(
    const SegmentRecord& record,
    InboundSegment& segment) {
  BlockRecord r;
  std::memcpy(&r, &record, sizeof(r));
  auto fits = [&](const Block& b) {
    return r.offset <= b.size() && segment.size <= b.size() - r.offset;
  };
  std::shared_ptr<Block> block;
  const bool own = r.kind == BlockRecord::kReturned;
  std::string why;
  if (r.kind == BlockRecord::kLent) {
    auto it = peerBlocks_.find(r.id);
    if (it == peerBlocks_.end()) {
      why = "record names unknown CUDA block " + std::to_string(r.id);
    } else {
      block = it->second;
    }
  } else if (own) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ownBlocks_.find(r.id);
    if (it == ownBlocks_.end() || it->second.state != OwnBlock::State::kLent) {
      why = "the peer handed back CUDA block " + std::to_string(r.id) +
          ", which it does not hold";
    } else if (fits(*it->second.block)) {
      block = it->second.block;
      it->second.state = OwnBlock::State::kLocal;
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
  *segment.provided = reinterpret_cast<void*>(block->address() + r.offset);
  if (!own) {
    // A block the peer lends again only once our lease on it died or was
    // handed back: a live one that was not is this frame's, whose segments
    // share it.
    auto& live = peerLeases_[r.id];
    if (auto lease = live.lock(); lease && !lease->handedOn()) {
      lease->share();
      *segment.region = std::move(lease);
      return static_cast<int64_t>(segment.size);
    }
    auto lease = std::make_shared<BlockLease>(
        weak_from_this(), std::move(block), r.id, own);
    live = lease;
    *segment.region = std::move(lease);
    return static_cast<int64_t>(segment.size);
  }
  *segment.region = std::make_shared<BlockLease>(
      weak_from_this(), std::move(block), r.id, own);
  return static_cast<int64_t>(segment.size);
}

} // namespace torch_rpc_ext::channel::cuda
