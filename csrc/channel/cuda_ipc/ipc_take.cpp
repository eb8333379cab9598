// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc's sending side, continued (ipc_channel.h): a frame's segments
// copied into blocks, one launch per device and stream, and a segment taken
// that its frame will not send given back.
#include "csrc/channel/cuda_ipc/ipc_channel.h"

#include <algorithm>
#include <cstring>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/channel/cuda_ipc/ipc_lease.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

using frame::SegmentRecord;

void IpcChannel::takeRegions(
    const std::vector<frame::OutboundFrame::Segment>& segments,
    const std::vector<size_t>& offered,
    std::vector<TakenRegion>* taken,
    std::vector<ControlFrame>* before,
    const std::shared_ptr<void>& /*keepAlive*/) {
  // One launch per device and stream (the codec readies every segment of a
  // device on one stream: one group per device).
  std::vector<size_t> group;
  std::vector<bool> done(offered.size(), false);
  for (size_t first = 0; first < offered.size(); ++first) {
    if (done[first]) {
      continue;
    }
    const auto& lead = segments[offered[first]];
    group.clear();
    for (size_t j = first; j < offered.size(); ++j) {
      const auto& s = segments[offered[j]];
      if (!done[j] && s.deviceIndex == lead.deviceIndex &&
          s.stream == lead.stream) {
        done[j] = true;
        group.push_back(offered[j]);
      }
    }
    takeGroup(segments, group, taken, before);
  }
}

void IpcChannel::takeGroup(
    const std::vector<frame::OutboundFrame::Segment>& segments,
    const std::vector<size_t>& group,
    std::vector<TakenRegion>* taken,
    std::vector<ControlFrame>* before) {
  const int device = segments[group.front()].deviceIndex;
  const auto stream =
      reinterpret_cast<CUstream>(segments[group.front()].stream);
  auto decline = [&](size_t count) {
    counters_.declined.fetch_add(count, std::memory_order_relaxed);
  };
  // Handed back, or to copy: small ones packed, large ones a block each.
  std::vector<size_t> small;
  std::vector<size_t> large;
  uint64_t packedBytes = 0;
  for (size_t i : group) {
    const auto& segment = segments[i];
    if (!reachable(segment)) {
      decline(1);
      continue;
    }
    SegmentRecord record{};
    if (handBack(segment, &record) || takeGrant(segment, before, &record)) {
      taken->push_back({i, record});
    } else if (lendingRefused_.load(std::memory_order_relaxed)) {
      decline(1); // the peer cannot map our blocks: the next channel's
    } else if (segment.size <= kPackMaxBytes) {
      packedBytes += (segment.size + kPackAlign - 1) / kPackAlign * kPackAlign;
      small.push_back(i);
    } else {
      large.push_back(i);
    }
  }
  // What to lend, then the copies into it: (segment, lent, offset).
  struct Placed {
    size_t segment;
    size_t lent;
    uint64_t offset;
  };
  std::vector<Lent> lent;
  std::vector<Placed> placed;
  size_t packed = 0;
  size_t launches = 0;
  try {
    if (!small.empty()) {
      Lent block = lend(device, packedBytes, before);
      if (block.id == 0) {
        decline(small.size());
      } else {
        lent.push_back(std::move(block));
        packed = small.size() > 1 ? small.size() : 0;
        uint64_t offset = 0;
        for (size_t i : small) {
          placed.push_back({i, lent.size() - 1, offset});
          offset +=
              (segments[i].size + kPackAlign - 1) / kPackAlign * kPackAlign;
        }
      }
    }
    for (size_t i : large) {
      Lent block = lend(device, segments[i].size, before);
      if (block.id == 0) {
        decline(1);
        continue;
      }
      lent.push_back(std::move(block));
      placed.push_back({i, lent.size() - 1, 0});
    }
    if (placed.empty()) {
      return;
    }
    // The one copy of this direction, one launch for the whole group, after
    // the caller's work on `stream` and the peer's last use of each block.
    // Strided views are packed by a launch each.
    std::vector<CopyEngine::Segment> copies;
    std::vector<CopyEngine::Segment> views;
    std::vector<const frame::StridedView*> viewShapes;
    copies.reserve(placed.size());
    for (const auto& p : placed) {
      const auto& segment = segments[p.segment];
      CopyEngine::Segment copy{
          lent[p.lent].block->address() + p.offset,
          reinterpret_cast<CUdeviceptr>(segment.data),
          segment.size};
      if (segment.view) {
        views.push_back(copy);
        viewShapes.push_back(segment.view.get());
      } else {
        copies.push_back(copy);
      }
      // A received storage sent on by copy is in use on `stream` until the
      // copy is done: its own block must not go back before.
      if (auto* region =
              dynamic_cast<frame::DeviceRegion*>(segment.origin.get())) {
        region->recordUse(segment.stream);
      }
    }
    CurrentDevice current(device);
    for (const auto& l : lent) {
      TORCH_RPC_EXT_CUDA_CHECK(
          cuStreamWaitEvent, stream, l.block->released(), 0);
    }
    CopyEngine& engine = copyEngine(device);
    engine.copySegments(stream, copies);
    for (size_t v = 0; v < views.size(); ++v) {
      const frame::StridedView& shape = *viewShapes[v];
      engine.pack(
          stream,
          views[v].dst,
          views[v].src,
          shape.sizes,
          shape.strides,
          shape.elementSize);
    }
    launches = (copies.empty() ? 0 : 1) + views.size();
    for (const auto& l : lent) {
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, l.block->ready(), stream);
    }
  } catch (...) {
    // The frame is not sent: the blocks go back to the pool (the peer hears
    // of new ones all the same), after whatever was queued into them (the
    // next copy waits on `released`); one whose record fails stays lent.
    for (const auto& l : lent) {
      if (libcuda().cuEventRecord(l.block->released(), stream) ==
          CUDA_SUCCESS) {
        unlend(l);
      }
    }
    throw;
  }
  counters_.launches.fetch_add(launches, std::memory_order_relaxed);
  counters_.packed.fetch_add(packed, std::memory_order_relaxed);
  // A legacy block's peer copies each segment out and releases the block
  // after the last of them in the frame (the one of the highest index: the
  // frame carries records in segment order).
  std::vector<size_t> lastOf(lent.size(), 0);
  for (const auto& p : placed) {
    lastOf[p.lent] = std::max(lastOf[p.lent], p.segment);
  }
  for (const auto& p : placed) {
    BlockRecord r{lent[p.lent].id, BlockRecord::kLent, p.offset};
    if (lent[p.lent].block->sharing() == Sharing::kLegacy) {
      r.kind = p.segment == lastOf[p.lent] && markLast_
          ? BlockRecord::kCopyOutLast
          : BlockRecord::kCopyOut;
    }
    SegmentRecord record;
    std::memcpy(&record, &r, sizeof(r));
    taken->push_back({p.segment, record});
    counters_.segments.fetch_add(1, std::memory_order_relaxed);
    counters_.copiedBytes.fetch_add(
        segments[p.segment].size, std::memory_order_relaxed);
  }
}

void IpcChannel::abandonRegion(
    const frame::OutboundFrame::Segment& segment,
    const SegmentRecord& record) {
  BlockRecord r;
  std::memcpy(&r, &record, sizeof(r));
  counters_.segments.fetch_sub(1, std::memory_order_relaxed);
  if (r.kind == BlockRecord::kReturned) {
    if (auto* lease = dynamic_cast<BlockLease*>(segment.origin.get())) {
      lease->keep();
    }
    counters_.handedBack.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  counters_.copiedBytes.fetch_sub(segment.size, std::memory_order_relaxed);
  if (r.kind == BlockRecord::kGranted) {
    // Back to the peer once the copy queued into it is over.
    counters_.grantsUsed.fetch_sub(1, std::memory_order_relaxed);
    abandonGrant(segment.deviceIndex, segment.stream, r.id);
    return;
  }
  if (r.offset != 0) {
    // A packed block goes back with its record at offset 0 (each lent block
    // has one), once: another frame may have it by the time a second
    // record of it would.
    return;
  }
  std::shared_ptr<Block> block;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ownBlocks_.find(r.id);
    if (it == ownBlocks_.end() || it->second.state != OwnBlock::State::kLent) {
      return;
    }
    block = it->second.block;
  }
  try {
    // The next copy into the block waits on `released`: recorded here, after
    // the copy that will not be sent, it orders that copy too.
    CurrentDevice current(block->device());
    TORCH_RPC_EXT_CUDA_CHECK(
        cuEventRecord,
        block->released(),
        reinterpret_cast<CUstream>(segment.stream));
  } catch (const std::exception& e) {
    logWarning(
        std::string(
            "torch_rpc_ext: cuda_ipc keeps lent a block it could not "
            "take back: ") +
        e.what());
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ownBlocks_.find(r.id);
  if (it != ownBlocks_.end() && it->second.state == OwnBlock::State::kLent) {
    it->second.state = OwnBlock::State::kFree;
    it->second.lastUsed = std::chrono::steady_clock::now();
    lentBytes_ -= it->second.block->size();
  }
}

} // namespace torch_rpc_ext::channel::cuda
