// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc's grants, the sender's side (ipc_channel.h; docs/cuda.md,
// "Grants"; the receiver's: ipc_grants.cpp): a peer's grant checked and its
// segment mapped, and a large segment written straight into it.
#include <algorithm>
#include <cstring>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/channel/lending.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

using frame::SegmentRecord;

bool IpcChannel::onGrantFromLoop(Host& host, const std::string& head) {
  GrantSetup g;
  std::memcpy(&g, head.data(), sizeof(g));
  std::string why;
  int local = -1;
  if (g.device >= peerDevices_.size() ||
      localDevices_.count(peerDevices_[g.device]) == 0) {
    why = "a CUDA grant for a device of the peer's that is not ours";
  } else if (
      g.bytes == 0 || g.segmentSize > kMaxGrantSegmentBytes ||
      g.offset > g.segmentSize || g.bytes > g.segmentSize - g.offset) {
    why = "a CUDA grant of " + std::to_string(g.bytes) + " bytes at " +
        std::to_string(g.offset) + " in a segment of " +
        std::to_string(g.segmentSize);
  } else if (!grantsPossible_) {
    why = "a CUDA grant where legacy handles do not reach the peer";
  } else if (g.slot >= kGrantSlots) {
    why = "a CUDA grant in slot " + std::to_string(g.slot);
  } else {
    local = localDevices_.at(peerDevices_[g.device]);
    std::lock_guard<std::mutex> lock(grantMu_);
    for (const auto& [id, in] : inGrants_) {
      if (id == g.id || (in.device == local && in.slot == int(g.slot))) {
        why = "a CUDA grant (" + std::to_string(g.id) + ", slot " +
            std::to_string(g.slot) + ") while one is out there";
      }
    }
  }
  bool revoked = false;
  if (why.empty()) {
    std::lock_guard<std::mutex> lock(grantMu_);
    auto early = std::find(earlyRevokes_.begin(), earlyRevokes_.end(), g.id);
    if (early != earlyRevokes_.end()) {
      earlyRevokes_.erase(early);
      endedGrantLocked(g.id);
      revoked = true;
    }
  }
  if (revoked) {
    // Taken back before it got here: back at once, never used.
    returnGrants(idHead(g.id));
    return true;
  }
  // The grant, ours to use until a record of ours or a return ends it
  // (address 0: its segment did not open; held unused).
  auto hold = [&](CUdeviceptr address, CUevent free) {
    std::lock_guard<std::mutex> lock(grantMu_);
    inGrants_[g.id] = InGrant{
        local,
        static_cast<int>(g.slot),
        static_cast<int>(g.device),
        g.bytes,
        address,
        free};
  };
  // The peer's segment and its free event, opened once each, here on the
  // loop thread (the only one that adds them), outside grantMu_.
  std::pair<CUdeviceptr, uint64_t> mapped{0, 0};
  bool known = false;
  if (why.empty()) {
    std::lock_guard<std::mutex> lock(grantMu_);
    auto seg = peerSegments_.find(g.segmentKey);
    known = seg != peerSegments_.end();
    if (known) {
      mapped = {seg->second.first, seg->second.second.first};
    } else if (peerSegments_.size() >= kMaxPeerSegments) {
      why = "a CUDA grant in a segment past the " +
          std::to_string(kMaxPeerSegments) + " the peer may have open";
    }
  }
  if (why.empty() && !known) {
    CUdeviceptr base = 0;
    size_t size = 0;
    try {
      CurrentDevice current(local);
      TORCH_RPC_EXT_CUDA_CHECK(
          cuIpcOpenMemHandle,
          &base,
          g.segment,
          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      CUdeviceptr start = 0;
      if (libcuda().cuMemGetAddressRange(&start, &size, base) != CUDA_SUCCESS ||
          start != base) {
        libcuda().cuIpcCloseMemHandle(base);
        throw std::runtime_error("the mapping's size is unknown");
      }
    } catch (const std::exception& e) {
      // Not ours to refuse: held unused (its slot's segments go by block)
      // until the peer takes it back. Given back now, the peer would make
      // it again at once, in the segment that just failed.
      logWarningLimited(
          "cuda_ipc_grant_open",
          std::string(
              "torch_rpc_ext: cuda_ipc could not open a peer's "
              "grant: ") +
              e.what());
      hold(0, nullptr);
      return true;
    }
    mapped = {base, size};
    std::lock_guard<std::mutex> lock(grantMu_);
    peerSegments_[g.segmentKey] = {base, {size, local}};
  }
  // What the mapping holds, not what the peer says: the bound of the copy.
  if (why.empty() &&
      (g.offset > mapped.second || g.bytes > mapped.second - g.offset)) {
    why = "a CUDA grant of " + std::to_string(g.bytes) + " bytes at " +
        std::to_string(g.offset) + " in a mapping of " +
        std::to_string(mapped.second);
  }
  CUevent free = nullptr;
  const SlotKey key{local, static_cast<int>(g.slot)};
  if (why.empty()) {
    auto it = peerFreeEvents_.find(key);
    if (it != peerFreeEvents_.end()) {
      free = it->second;
    } else {
      try {
        CurrentDevice current(local);
        TORCH_RPC_EXT_CUDA_CHECK(cuIpcOpenEventHandle, &free, g.free);
      } catch (const std::exception& ex) {
        why = std::string("a CUDA grant's event does not open: ") + ex.what();
      }
      if (why.empty()) {
        std::lock_guard<std::mutex> lock(grantMu_);
        peerFreeEvents_[key] = free;
      }
    }
  }
  if (!why.empty()) {
    host.rejectFromLoop("rejected frame: " + why); // (no lock held)
    return false;
  }
  hold(mapped.first + g.offset, free);
  return true;
}

bool IpcChannel::takeGrant(
    const frame::OutboundFrame::Segment& segment,
    std::vector<ControlFrame>* before,
    SegmentRecord* out) {
  if (segment.size <= kGrantMinBytes) {
    return false;
  }
  const int device = segment.deviceIndex;
  const auto stream = reinterpret_cast<CUstream>(segment.stream);
  // Held through the copy: the close waits for the copies it knows of
  // before it unmaps the peer's segments.
  std::unique_lock<std::mutex> lock(grantMu_);
  // The smallest of the peer's grants for the device that fits.
  auto it = inGrants_.end();
  for (auto at = inGrants_.begin(); at != inGrants_.end(); ++at) {
    const InGrant& in = at->second;
    if (in.device == device && in.address != 0 &&
        grantFits(in.bytes, segment.size) &&
        (segment.peerDevice < 0 || segment.peerDevice == in.peerDevice) &&
        (it == inGrants_.end() || in.bytes < it->second.bytes)) {
      it = at;
    }
  }
  if (it == inGrants_.end()) {
    return false;
  }
  const uint32_t id = it->first;
  const InGrant g = it->second;
  CurrentDevice current(device);
  auto known = grantEvents_.find({device, g.slot});
  CUevent written = known == grantEvents_.end() ? nullptr : known->second;
  if (written == nullptr) {
    // Ours, once per device and slot: the peer opens it and, as each
    // record arrives, captures its record for that grant's copy
    // (GrantedRegion).
    GrantEventSetup setup{};
    setup.device = static_cast<uint32_t>(g.peerDevice);
    setup.slot = static_cast<uint32_t>(g.slot);
    TORCH_RPC_EXT_CUDA_CHECK(
        cuEventCreate,
        &written,
        CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
    if (libcuda().cuIpcGetEventHandle(&setup.event, written) != CUDA_SUCCESS) {
      libcuda().cuEventDestroy(written);
      return false; // by block
    }
    grantEvents_[{device, g.slot}] = written;
    before->push_back(
        ControlFrame{
            context().wireIds().kind(kGrantEvent),
            std::string(reinterpret_cast<const char*>(&setup), sizeof(setup)),
            {},
            nullptr});
  }
  inGrants_.erase(it);
  endedGrantLocked(id);
  try {
    // The one copy of this direction: after the caller's work on `stream`
    // and the grant's last use on the receiver's side.
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, g.free, 0);
    const auto src = reinterpret_cast<CUdeviceptr>(segment.data);
    if (segment.view) {
      // Packed into it as into a block: the receiver's tensor is dense.
      // (Else the receiver, which grants what arrived by block, would
      // grant a strided tensor's size over and over, never used.)
      const frame::StridedView& shape = *segment.view;
      copyEngine(device).pack(
          stream,
          g.address,
          src,
          shape.sizes,
          shape.strides,
          shape.elementSize);
    } else {
      copyEngine(device).copySegments(stream, {{g.address, src, segment.size}});
    }
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, written, stream);
    // Each copy's own completion, for the close (the event above says only
    // the latest, maybe of another stream).
    PooledEvent copied = StagingPool::of(device).takeEvent();
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, copied.get(), stream);
    grantCopies_.erase(
        std::remove_if(
            grantCopies_.begin(),
            grantCopies_.end(),
            [](const PooledEvent& e) {
              return libcuda().cuEventQuery(e.get()) == CUDA_SUCCESS;
            }),
        grantCopies_.end());
    grantCopies_.push_back(std::move(copied));
  } catch (...) {
    // The copy may be queued, and no record will name the grant: it goes
    // back once nothing of ours can still write it (a failed stream's
    // work is over too), as a frame's that was not sent does. (The wait
    // without the grants' lock: the loop's grants and the frames' writes
    // take it.)
    lock.unlock();
    libcuda().cuStreamSynchronize(stream);
    returnGrants(idHead(id));
    throw;
  }
  lock.unlock();
  if (auto* region = dynamic_cast<frame::DeviceRegion*>(segment.origin.get())) {
    region->recordUse(segment.stream);
  }
  BlockRecord r{id, BlockRecord::kGranted, 0};
  std::memcpy(out, &r, sizeof(r));
  counters_.grantsUsed.fetch_add(1, std::memory_order_relaxed);
  counters_.segments.fetch_add(1, std::memory_order_relaxed);
  counters_.copiedBytes.fetch_add(segment.size, std::memory_order_relaxed);
  return true;
}

} // namespace torch_rpc_ext::channel::cuda
