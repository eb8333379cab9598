// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc's sending side (ipc_channel.h): our pool of device blocks lent
// to the peer, and their return; the copies of a frame's segments into them
// are ipc_take.cpp's.
#include "csrc/channel/cuda_ipc/ipc_channel.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda_ipc/ipc_lease.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::channel::cuda {

using frame::SegmentRecord;

// ---- IpcChannel ------------------------------------------------------------

IpcChannel::IpcChannel(
    std::shared_ptr<const Context> context,
    std::weak_ptr<Host> host,
    IpcCounters& counters,
    const IpcDomain& local,
    const IpcDomain& peer)
    : Channel(std::move(context)), host_(std::move(host)), counters_(counters) {
  for (const auto& d : peer.devices) {
    peerDevices_.push_back(d.uuid);
    peerReach_.push_back(d.fd ? d.peers : std::vector<int>());
  }
  // Tests only: a sender that never marks a legacy block's last record
  // (tests/cuda_driver/test_ipc_legacy.py: the receiver refuses the frame).
  const char* noLast = std::getenv("TORCH_RPC_EXT_TEST_CUDA_IPC_NO_LAST");
  markLast_ = noLast == nullptr || std::string(noLast) != "1";
  // Grants go by legacy handle: one host and PID namespace, two processes.
  grantsPossible_ = !local.host.empty() && local.host == peer.host &&
      !local.pidNamespace.empty() && local.pidNamespace == peer.pidNamespace &&
      !local.pid.empty() && !peer.pid.empty() && local.pid != peer.pid;
  for (int d = 0; d < deviceCount(); ++d) {
    const std::string uuid = deviceUuid(d);
    localDevices_.emplace(uuid, d);
    if (auto sharing = local.sharingWith(peer, uuid)) {
      sharing_.emplace(d, *sharing);
      granularity_.emplace(d, ExportedMemory::granularity(d, *sharing));
      if ((*sharing == Sharing::kLegacy || grantsPossible_) &&
          peerProcess_ == nullptr) {
        peerProcess_ = ProcessWatch::open(peer.pid);
      }
    }
  }
}

IpcChannel::~IpcChannel() = default;

bool IpcChannel::reachable(const frame::OutboundFrame::Segment& segment) {
  const int device = segment.deviceIndex;
  std::string uuid;
  for (const auto& [u, d] : localDevices_) {
    if (d == device) {
      uuid = u;
    }
  }
  // The peer must see the device, and, where the sender's map says which of
  // the peer's devices the bytes go to, that must be this one, or one that
  // the peer says reads this one's memory peer to peer (a descriptor's
  // block only: a map {0: 1} on an NVLink node). Else the next channel,
  // cuda_staged, carries it through host memory.
  const auto seen = uuid.empty()
      ? peerDevices_.end()
      : std::find(peerDevices_.begin(), peerDevices_.end(), uuid);
  auto sharing = sharing_.find(device);
  if (sharing == sharing_.end() || seen == peerDevices_.end()) {
    return false;
  }
  const int target = segment.peerDevice;
  if (target < 0 ||
      (size_t(target) < peerDevices_.size() && peerDevices_[target] == uuid)) {
    return true;
  }
  const auto& reach = peerReach_[seen - peerDevices_.begin()];
  return sharing->second == Sharing::kFd &&
      std::find(reach.begin(), reach.end(), target) != reach.end();
}

bool IpcChannel::handBack(
    const frame::OutboundFrame::Segment& segment,
    SegmentRecord* out) {
  // A storage in a block the peer lent us on this connection, that nothing
  // else can reach (no other storage views the block), goes back as it is:
  // the owner's next use waits for ours through `released`.
  auto* lease = dynamic_cast<BlockLease*>(segment.origin.get());
  if (!segment.exclusive || lease == nullptr) {
    return false;
  }
  const int device = segment.deviceIndex;
  const auto p = reinterpret_cast<CUdeviceptr>(segment.data);
  const Block& block = lease->block();
  // Handed back, the block is its owner's on its own device: only where the
  // map sends the tensor there (not to another device that reaches it).
  const int target = segment.peerDevice;
  const bool home = target < 0 ||
      (size_t(target) < peerDevices_.size() &&
       localDevices_.count(peerDevices_[target]) != 0 &&
       localDevices_.at(peerDevices_[target]) == block.device());
  if (!home || !lease->isOf(this) || lease->own() || lease->shared() ||
      block.device() != device || p < block.address() ||
      segment.size > block.size() ||
      p - block.address() > block.size() - segment.size || !lease->handOn()) {
    return false;
  }
  {
    // After the bytes arrived (in case `stream` never waited for them)
    // and after the caller's work on `stream`.
    const auto stream = reinterpret_cast<CUstream>(segment.stream);
    CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, block.ready(), 0);
    lease->joinUses(stream);
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block.released(), stream);
    // And ours: were the connection to close now, the block's import is
    // unmapped only after this (Block's teardown waits for `localUse`),
    // as after a lease that dies here rather than being handed on.
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block.localUse(), stream);
  }
  static_assert(sizeof(BlockRecord) == sizeof(*out));
  BlockRecord r{lease->id(), BlockRecord::kReturned, p - block.address()};
  counters_.handedBack.fetch_add(1, std::memory_order_relaxed);
  counters_.segments.fetch_add(1, std::memory_order_relaxed);
  std::memcpy(out, &r, sizeof(r));
  return true;
}

IpcChannel::Lent IpcChannel::lend(
    int device,
    uint64_t want,
    std::vector<ControlFrame>* before) {
  want = std::max<uint64_t>(want, 1);
  Lent lent;
  if (auto host = host_.lock(); !host || host->isClosed()) {
    return lent; // declined: no block lent on a connection that closed
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The smallest free block of the device that fits without wasting
    // more than half.
    uint64_t best = std::numeric_limits<uint64_t>::max();
    for (auto& [blockId, own] : ownBlocks_) {
      uint64_t size = own.block->size();
      if (own.state == OwnBlock::State::kFree &&
          own.block->device() == device && size >= want &&
          (size <= 2 * want || size == granularity_.at(device)) &&
          size < best) {
        best = size;
        lent.id = blockId;
      }
    }
    if (lent.id != 0) {
      auto& own = ownBlocks_[lent.id];
      own.state = OwnBlock::State::kLent;
      lentBytes_ += own.block->size();
      lent.block = own.block;
      return lent;
    }
    if (ownBlocks_.size() + blocksBeingMade_ >= kMaxBlocks ||
        lentBytes_ + want > kMaxLentBlockBytes ||
        lendingRefused_.load(std::memory_order_relaxed)) {
      return lent; // (refused: a frame that passed takeGroup's check)
    }
    lent.id = nextBlockId_++;
    lentBytes_ += want;
    ++blocksBeingMade_;
  }
  lent.fresh = true;
  const Sharing sharing = sharing_.at(device);
  std::string setup;
  int fd = -1;
  try {
    lent.block = Block::create(device, want, sharing);
    if (lent.block == nullptr) {
      // Over the bound or out of memory: declined, to the next channel.
      std::lock_guard<std::mutex> lock(mu_);
      --blocksBeingMade_;
      lentBytes_ -= want;
      return Lent{};
    }
    setup = lent.block->describe(lent.id);
    if (sharing == Sharing::kFd) {
      fd = lent.block->exportFd();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    --blocksBeingMade_;
    lentBytes_ -= want;
    throw;
  }
  bool closed;
  std::shared_ptr<std::atomic<bool>> announced;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --blocksBeingMade_;
    auto host = host_.lock();
    // onClosedFromLoop() takes mu_ after the close: checked here, a block
    // made meanwhile is never left out of its sweep.
    closed = !host || host->isClosed();
    if (closed) {
      lentBytes_ -= want;
    } else {
      lentBytes_ += lent.block->size() - want;
      auto& own =
          ownBlocks_
              .emplace(
                  lent.id, OwnBlock{lent.block, OwnBlock::State::kLent, {}})
              .first->second;
      announced = own.announced;
    }
  }
  if (closed) {
    if (fd >= 0) {
      ::close(fd);
    }
    lent.block->orphan(std::chrono::steady_clock::now()); // never shared
    return Lent{}; // declined; its last holder retires it
  }
  counters_.created.fetch_add(1, std::memory_order_relaxed);
  if (sharing == Sharing::kLegacy) {
    counters_.legacyBlocks.fetch_add(1, std::memory_order_relaxed);
    before->push_back(
        ControlFrame{
            context().wireIds().kind(kBlockSetup),
            std::move(setup),
            {},
            std::shared_ptr<void>(
                nullptr, [announced](void*) { announced->store(true); })});
    return lent;
  }
  // The setup reaches the peer before the first record naming the block;
  // the descriptor is closed once the frame is out (or dropped).
  before->push_back(
      ControlFrame{
          context().wireIds().kind(kBlockSetup),
          std::move(setup),
          {fd},
          std::shared_ptr<void>(nullptr, [fd, announced](void*) {
            ::close(fd);
            announced->store(true);
          })});
  return lent;
}

void IpcChannel::unlend(const Lent& lent) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ownBlocks_.find(lent.id);
  if (it != ownBlocks_.end() && it->second.state == OwnBlock::State::kLent) {
    lentBytes_ -= it->second.block->size();
    it->second.state = OwnBlock::State::kFree;
    it->second.lastUsed = std::chrono::steady_clock::now();
  }
}

void IpcChannel::freeOwnBlock(uint32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ownBlocks_.find(id);
  if (it != ownBlocks_.end() && it->second.state == OwnBlock::State::kLocal) {
    it->second.state = OwnBlock::State::kFree;
    it->second.lastUsed = std::chrono::steady_clock::now();
  }
}

void IpcChannel::onClosedFromLoop() {
  // A frame cut short: its copies out are never made, and nothing waits
  // for them (its message is not delivered).
  copyOuts_.clear();
  closeGrantsFromLoop();
  // One deadline for the whole channel's legacy teardown waits.
  const auto patience = std::chrono::steady_clock::now() +
      std::chrono::milliseconds(kLegacyTeardownWaitMs);
  for (auto& [id, block] : peerBlocks_) {
    block->orphan(patience);
  }
  // What only the channel holds goes now, not with the connection (a
  // request still served for the peer holds it as long as it runs): each
  // block's last holder retires it on the staging thread once its waits
  // are over. A lease keeps its own block; a peer's legacy block is
  // unmapped only after our copies out of it (block.cpp). Our legacy
  // blocks stay until the connection goes, as before: their teardown
  // waits for the peer's copies out of them past the deadline above as
  // long as the peer lives, where we know its process.
  auto legacy = [](const std::shared_ptr<Block>& b) {
    return b->sharing() == Sharing::kLegacy;
  };
  std::vector<std::shared_ptr<Block>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = ownBlocks_.begin(); it != ownBlocks_.end();) {
      if (legacy(it->second.block)) {
        it->second.block->orphan(
            patience, peerProcess_, it->second.state == OwnBlock::State::kLent);
        ++it;
      } else {
        it->second.block->orphan(patience);
        dropped.push_back(std::move(it->second.block));
        it = ownBlocks_.erase(it); // (lentBytes_ gates lend(), shut now)
      }
    }
  }
  peerBlocks_.clear();
  refusedBlocks_.clear();
  peerLeases_.clear();
  peerDropped_.clear();
}

bool IpcChannel::onFrameEndFromLoop() {
  postGrantsFromLoop();
  if (copyOuts_.empty()) {
    return true;
  }
  const uint32_t id = copyOuts_.begin()->first;
  copyOuts_.clear();
  if (auto host = host_.lock()) {
    host->rejectFromLoop(
        "rejected frame: it ended with segments of CUDA block " +
        std::to_string(id) + " not copied out (no record marked last)");
  }
  return false;
}

std::shared_ptr<CUstream_st> IpcChannel::streamOf(
    std::map<int, std::shared_ptr<CUstream_st>>& made,
    int device) {
  auto it = made.find(device);
  if (it != made.end()) {
    return it->second;
  }
  CurrentDevice current(device);
  CUstream raw = nullptr;
  TORCH_RPC_EXT_CUDA_CHECK(cuStreamCreate, &raw, CU_STREAM_NON_BLOCKING);
  // Destroyed with the last region that may still record on it (the
  // driver frees it once its queued work is done).
  std::shared_ptr<CUstream_st> stream(raw, [device](CUstream_st* s) {
    try {
      CurrentDevice current(device);
      libcuda().cuStreamDestroy(s);
    } catch (const std::exception&) {
      // The driver is gone (process exit).
    }
  });
  made.emplace(device, stream);
  return stream;
}

} // namespace torch_rpc_ext::channel::cuda
