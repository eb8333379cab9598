// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc (ipc_channel.h): our pool of device blocks lent to the peer, the
// peer's blocks we map, and the leases that tie a received tensor's storage
// to a block.
#include "csrc/channel/cuda/ipc_channel.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/engines.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

using frame::FrameKind;
using frame::SegmentRecord;

// The peer may have at most this many bytes of blocks mapped into us.
constexpr uint64_t kMaxPeerBlockBytes = 2 * kMaxLentBlockBytes;

// A received segment's memory: a span of a block, valid while this lives.
// When it dies, the block goes back to its owner once the work queued by
// then on every stream it was used on has finished (the `released` event).
class BlockLease final : public DeviceRegion {
 public:
  BlockLease(
      std::weak_ptr<IpcChannel> conn,
      std::shared_ptr<Block> block,
      uint32_t id,
      bool own)
      : conn_(std::move(conn)), block_(std::move(block)), id_(id), own_(own) {}

  ~BlockLease() override {
    if (handedOn_.load()) {
      return; // the frame that passed it on recorded `released`
    }
    try {
      std::lock_guard<std::mutex> lock(mu_);
      if (!streams_.empty()) {
        CurrentDevice current(block_->device());
        const auto last = reinterpret_cast<CUstream>(streams_.back());
        joinUsesLocked(last);
        // Ours, which the block waits for before it is unmapped; and,
        // while the peer is there (its events may be gone with it), the
        // one the next copy into the block waits for.
        TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block_->localUse(), last);
        if (!block_->orphaned()) {
          TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block_->released(), last);
        }
      }
    } catch (const std::exception& e) {
      // The block is not given back: the next copy must not race this
      // use. It is freed with the connection.
      logWarning(
          std::string(
              "torch_rpc_ext: cuda_ipc keeps a block it could not "
              "release: ") +
          e.what());
      return;
    }
    if (auto c = conn_.lock()) {
      if (own_) {
        c->freeOwnBlock(id_);
      } else {
        c->releasePeerBlock(id_);
      }
    }
  }

  int device() const override {
    return block_->device();
  }

  void waitOn(uintptr_t stream) override {
    CurrentDevice current(block_->device());
    // A block the peer filled is ready at its `ready` record; one of ours
    // it handed back, at its `released` record.
    TORCH_RPC_EXT_CUDA_CHECK(
        cuStreamWaitEvent,
        reinterpret_cast<CUstream>(stream),
        own_ ? block_->released() : block_->ready(),
        0);
    recordUse(stream);
  }

  // The memory is read or written on `stream` too (a copy of it sent on).
  void recordUse(uintptr_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) {
      streams_.push_back(stream);
    }
  }

  // Makes `into` wait for the work queued so far on every other stream the
  // memory was used on.
  void joinUses(CUstream into) {
    std::lock_guard<std::mutex> lock(mu_);
    joinUsesLocked(into);
  }

  // Whether this lease came from `channel` (a live one: a new channel may
  // sit at a closed one's address).
  bool isOf(const IpcChannel* channel) const {
    return conn_.lock().get() == channel;
  }

  const Block& block() const {
    return *block_;
  }
  uint32_t id() const {
    return id_;
  }
  bool own() const {
    return own_;
  }
  bool handOn() {
    return !handedOn_.exchange(true);
  }
  // That frame was not sent after all: the lease gives the block back
  // itself (the records the hand-back made only order more work).
  void keep() {
    handedOn_.store(false);
  }

 private:
  void joinUsesLocked(CUstream into) {
    for (uintptr_t s : streams_) {
      const auto other = reinterpret_cast<CUstream>(s);
      if (other == into) {
        continue;
      }
      CUevent e = nullptr;
      TORCH_RPC_EXT_CUDA_CHECK(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
      libcuda().cuEventRecord(e, other);
      libcuda().cuStreamWaitEvent(into, e, 0);
      libcuda().cuEventDestroy(e); // freed once its record completes
    }
  }

  std::weak_ptr<IpcChannel> conn_;
  std::shared_ptr<Block> block_;
  uint32_t id_;
  bool own_;
  std::mutex mu_;
  std::vector<uintptr_t> streams_; // of device(), in first-use order
  std::atomic<bool> handedOn_{false};
};

} // namespace

// ---- IpcChannel ------------------------------------------------------------

IpcChannel::IpcChannel(
    std::shared_ptr<const Context> context,
    std::weak_ptr<Host> host,
    IpcCounters& counters,
    std::vector<std::string> peerDevices)
    : Channel(std::move(context)),
      host_(std::move(host)),
      counters_(counters),
      peerDevices_(std::move(peerDevices)) {
  for (int d = 0; d < deviceCount(); ++d) {
    localDevices_.emplace(deviceUuid(d), d);
    if (supportsFdExport(d)) {
      granularity_.emplace(d, ExportedMemory::granularity(d));
    }
  }
}

IpcChannel::~IpcChannel() = default;

bool IpcChannel::takeRegion(
    const frame::OutboundFrame::Segment& segment,
    SegmentRecord* out,
    std::vector<ControlFrame>* before) {
  const int device = segment.deviceIndex;
  const auto stream = reinterpret_cast<CUstream>(segment.stream);
  std::string uuid;
  for (const auto& [u, d] : localDevices_) {
    if (d == device) {
      uuid = u;
    }
  }
  // The peer must see the device, and, where the sender's map says which of
  // the peer's devices the bytes go to, that must be this one: a block is
  // mapped on the device it lives on (a map between two devices is left to
  // the next channel, cuda_staged).
  const bool seen = !uuid.empty() &&
      std::find(peerDevices_.begin(), peerDevices_.end(), uuid) !=
          peerDevices_.end();
  const bool target = segment.peerDevice < 0 ||
      (size_t(segment.peerDevice) < peerDevices_.size() &&
       peerDevices_[segment.peerDevice] == uuid);
  if (granularity_.count(device) == 0 || !seen || !target) {
    counters_.declined.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  static_assert(sizeof(BlockRecord) == sizeof(*out));
  // A storage in a block the peer lent us on this connection, that nothing
  // else can reach, goes back as it is: the owner's next use waits for ours
  // through `released`.
  auto* lease = dynamic_cast<BlockLease*>(segment.origin.get());
  if (segment.exclusive && lease != nullptr) {
    const auto p = reinterpret_cast<CUdeviceptr>(segment.data);
    if (lease->isOf(this) && !lease->own() &&
        lease->block().device() == device && p >= lease->block().address() &&
        segment.size <= lease->block().size() &&
        p - lease->block().address() <= lease->block().size() - segment.size &&
        lease->handOn()) {
      {
        // After the bytes arrived (in case `stream` never waited for them)
        // and after the caller's work on `stream`.
        CurrentDevice current(device);
        TORCH_RPC_EXT_CUDA_CHECK(
            cuStreamWaitEvent, stream, lease->block().ready(), 0);
        lease->joinUses(stream);
        TORCH_RPC_EXT_CUDA_CHECK(
            cuEventRecord, lease->block().released(), stream);
      }
      BlockRecord r{
          lease->id(), BlockRecord::kReturned, p - lease->block().address()};
      counters_.handedBack.fetch_add(1, std::memory_order_relaxed);
      counters_.segments.fetch_add(1, std::memory_order_relaxed);
      std::memcpy(out, &r, sizeof(r));
      return true;
    }
  }
  const uint64_t want = std::max<uint64_t>(segment.size, 1);
  std::shared_ptr<Block> block;
  uint32_t id = 0;
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
        id = blockId;
      }
    }
    if (id != 0) {
      auto& own = ownBlocks_[id];
      own.state = OwnBlock::State::kLent;
      lentBytes_ += own.block->size();
      block = own.block;
    } else if (
        ownBlocks_.size() + blocksBeingMade_ >= kMaxBlocks ||
        lentBytes_ + want > kMaxLentBlockBytes) {
      counters_.declined.fetch_add(1, std::memory_order_relaxed);
      return false;
    } else {
      id = nextBlockId_++;
      lentBytes_ += want;
      ++blocksBeingMade_;
    }
  }
  const bool fresh = block == nullptr;
  if (fresh) {
    BlockSetup setup;
    int fd = -1;
    try {
      block = Block::create(device, want);
      setup = block->describe(id);
      fd = block->exportFd();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      --blocksBeingMade_;
      lentBytes_ -= want;
      throw;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      --blocksBeingMade_;
      lentBytes_ += block->size() - want;
      ownBlocks_.emplace(id, OwnBlock{block, OwnBlock::State::kLent, {}});
    }
    counters_.created.fetch_add(1, std::memory_order_relaxed);
    // The setup reaches the peer before the first record naming the block;
    // the descriptor is closed once the frame is out (or dropped).
    before->push_back(
        ControlFrame{
            context().wireIds().kind(kBlockSetup),
            std::string(reinterpret_cast<const char*>(&setup), sizeof(setup)),
            {fd},
            std::shared_ptr<void>(nullptr, [fd](void*) { ::close(fd); })});
  }
  // A received storage sent on by copy is in use on `stream` until the
  // copy is done: its own block must not go back before.
  if (lease != nullptr) {
    lease->recordUse(segment.stream);
  }
  // The one copy of this direction, after the caller's work on `stream` and
  // the peer's last use of the block.
  try {
    CurrentDevice current(device);
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, stream, block->released(), 0);
    copyEngine(device).copy(
        stream,
        block->address(),
        reinterpret_cast<CUdeviceptr>(segment.data),
        segment.size);
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block->ready(), stream);
  } catch (...) {
    // The frame is not sent: a pooled block goes back to the pool, a new
    // one (which the peer will never hear of) goes.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ownBlocks_.find(id);
    if (it != ownBlocks_.end()) {
      lentBytes_ -= block->size();
      if (fresh) {
        ownBlocks_.erase(it);
      } else {
        it->second.state = OwnBlock::State::kFree;
        it->second.lastUsed = std::chrono::steady_clock::now();
      }
    }
    throw;
  }
  BlockRecord r{id, BlockRecord::kLent, 0};
  counters_.segments.fetch_add(1, std::memory_order_relaxed);
  counters_.copiedBytes.fetch_add(segment.size, std::memory_order_relaxed);
  std::memcpy(out, &r, sizeof(r));
  return true;
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
  counters_.copiedBytes.fetch_sub(segment.size, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ownBlocks_.find(r.id);
  if (it != ownBlocks_.end() && it->second.state == OwnBlock::State::kLent) {
    it->second.state = OwnBlock::State::kFree;
    it->second.lastUsed = std::chrono::steady_clock::now();
    lentBytes_ -= it->second.block->size();
  }
}

void IpcChannel::releasePeerBlock(uint32_t id) {
  auto host = host_.lock();
  if (!host || host->isClosed()) {
    return; // nobody left to tell
  }
  // Device blocks are large and few: each goes back at once, so that its
  // owner does not make another meanwhile.
  host->sendControl(
      ControlFrame{
          context().wireIds().kind(kBlockRelease), idHead(id), {}, nullptr});
}

void IpcChannel::freeOwnBlock(uint32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ownBlocks_.find(id);
  if (it != ownBlocks_.end() && it->second.state == OwnBlock::State::kLocal) {
    it->second.state = OwnBlock::State::kFree;
    it->second.lastUsed = std::chrono::steady_clock::now();
  }
}

void IpcChannel::onTickFromLoop() {
  trim();
}

void IpcChannel::onClosedFromLoop() {
  for (auto& [id, block] : peerBlocks_) {
    block->orphan();
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, own] : ownBlocks_) {
    own.block->orphan();
  }
}

void IpcChannel::trim() {
  // Free blocks idle for kBlockIdleMs whose events have completed (so that
  // unmapping one never waits on the loop thread for the GPU, ours or the
  // peer's), asked outside the lock.
  std::vector<std::pair<uint32_t, std::shared_ptr<Block>>> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto now = std::chrono::steady_clock::now();
    for (auto& [id, own] : ownBlocks_) {
      if (own.state == OwnBlock::State::kFree &&
          now - own.lastUsed >= std::chrono::milliseconds(kBlockIdleMs)) {
        idle.emplace_back(id, own.block);
      }
    }
  }
  if (idle.empty()) {
    return;
  }
  std::vector<uint32_t> quiet;
  for (const auto& [id, block] : idle) {
    CurrentDevice current(block->device());
    if (libcuda().cuEventQuery(block->ready()) == CUDA_SUCCESS &&
        libcuda().cuEventQuery(block->released()) == CUDA_SUCCESS &&
        libcuda().cuEventQuery(block->localUse()) == CUDA_SUCCESS) {
      quiet.push_back(id);
    }
  }
  idle.clear();
  std::vector<uint32_t> dropped;
  std::vector<std::shared_ptr<Block>> unmap; // outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint32_t id : quiet) {
      auto it = ownBlocks_.find(id);
      if (it != ownBlocks_.end() &&
          it->second.state == OwnBlock::State::kFree) {
        dropped.push_back(id);
        unmap.push_back(std::move(it->second.block));
        ownBlocks_.erase(it);
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
            context().wireIds().kind(kBlockDrop), idHead(id), {}, nullptr});
  }
}

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
  *segment.region = std::make_shared<BlockLease>(
      weak_from_this(), std::move(block), r.id, own);
  return static_cast<int64_t>(segment.size);
}

} // namespace torch_rpc_ext::channel::cuda
