// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/cuda_ipc/block.h"

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/device_memory.h"
#include "csrc/channel/cuda/staging_thread.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/common/exit_gate.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

CUevent newIpcEvent() {
  CUevent e = nullptr;
  TORCH_RPC_EXT_CUDA_CHECK(
      cuEventCreate, &e, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
  return e;
}

} // namespace

std::shared_ptr<Block> Block::create(
    int device,
    uint64_t bytes,
    Sharing sharing) {
  std::shared_ptr<Block> b(new Block(), &Block::retire);
  b->owner_ = true;
  // Bounded per device (device_memory.h); out of memory once, torch's
  // cache is freed and the block made again.
  const uint64_t g = ExportedMemory::granularity(device, sharing);
  const uint64_t size = (std::max<uint64_t>(bytes, 1) + g - 1) / g * g;
  if (!reserveIpc(device, size)) {
    return nullptr;
  }
  b->device_ = device;
  b->accounted_ = size; // given back by ~Block, whatever follows
  try {
    allocateWithRetry(device, [&] {
      b->memory_ = ExportedMemory::create(device, bytes, sharing);
    });
  } catch (const CudaError& e) {
    if (e.code() != CUDA_ERROR_OUT_OF_MEMORY) {
      throw;
    }
    countIpcDeclined();
    return nullptr;
  }
  CurrentDevice current(device);
  b->ready_ = newIpcEvent();
  b->released_ = newIpcEvent();
  TORCH_RPC_EXT_CUDA_CHECK(
      cuEventCreate, &b->localUse_, CU_EVENT_DISABLE_TIMING);
  return b;
}

std::shared_ptr<Block> Block::import(
    const BlockSetup& setup,
    int fd,
    const CUipcMemHandle* legacy,
    int device) {
  std::shared_ptr<Block> b(new Block(), &Block::retire);
  b->memory_ = legacy != nullptr
      ? ExportedMemory::importLegacy(*legacy, setup.size, device)
      : ExportedMemory::import(fd, setup.size, device);
  CurrentDevice current(device);
  try {
    TORCH_RPC_EXT_CUDA_CHECK(cuIpcOpenEventHandle, &b->ready_, setup.ready);
    TORCH_RPC_EXT_CUDA_CHECK(
        cuIpcOpenEventHandle, &b->released_, setup.released);
    TORCH_RPC_EXT_CUDA_CHECK(
        cuEventCreate, &b->localUse_, CU_EVENT_DISABLE_TIMING);
  } catch (...) {
    // Undone now, before the caller answers the peer (a refusal: the owner
    // then frees the block at once), never later on the staging thread:
    // nothing of ours was queued on it yet.
    for (CUevent* e : {&b->ready_, &b->released_, &b->localUse_}) {
      if (*e != nullptr) {
        libcuda().cuEventDestroy(*e);
        *e = nullptr;
      }
    }
    b->memory_.reset();
    throw;
  }
  return b;
}

void Block::retire(Block* b) {
  if (b->memory_ == nullptr) {
    delete b; // making or importing it failed: nothing to wait for
    return;
  }
  if (ExitGate::closed()) {
    return; // exiting: the staging thread has parked, the driver ends it all
  }
  // Wherever the last reference went (a loop thread, a thread freeing a
  // received tensor), the wait for the block's events happens on the
  // staging thread, which polls them: one a peer records may never
  // complete, and a block it holds is kept rather than a thread.
  try {
    auto since = std::chrono::steady_clock::now();
    auto warned = std::make_shared<bool>(false);
    runOnStagingThreadWhen(
        [b, since, warned] {
          if (b->teardownReady()) {
            return true;
          }
          if (!*warned &&
              std::chrono::steady_clock::now() - since > kTeardownWarnAfter) {
            *warned = true;
            logWarning(
                "torch_rpc_ext: a cuda_ipc block of " +
                std::to_string(b->size()) + " bytes " +
                (b->owner_ ? "of ours" : "of the peer's") +
                " still waits, after " +
                std::to_string(kTeardownWarnAfter.count()) +
                " s, for the device work on it to complete (a stream "
                "stuck behind work that never ends, a peer's event "
                "that is never recorded as done, or a peer alive after "
                "the close and not done copying out of it); it is freed "
                "once that completes (or that peer exits)");
          }
          return false;
        },
        [b] { delete b; });
  } catch (const std::exception& e) {
    // (A deleter must not throw.) Kept, not waited for here.
    logWarning(
        std::string("torch_rpc_ext: a cuda_ipc block is kept, not freed: ") +
        e.what());
  }
}

std::vector<Block::TeardownWait> Block::teardownWaits() const {
  // Unmapping under a copy or a kernel still reading it would fault the
  // device: wait for the last records (teardown only; a block is never
  // freed on an RPC's path): ours, and the peer's while it is there (a
  // peer gone may have left records that never complete; our own last use
  // of its memory was waited for when its lease died).
  const bool peerThere = !orphaned_.load();
  const bool legacy = sharing() == Sharing::kLegacy;
  // Our own last use is waited for however long it takes: a copy out of
  // the peer's legacy block may be queued behind a dead peer's `ready`,
  // which never completes, and unmapping under it would have it read
  // memory gone (or, where closing the mapping synchronises, hang the
  // staging thread with it). Such a block is kept, and named in the log
  // (retire()), as a grant's mapping is (ipc_grant_ends.cpp). Only the
  // peer's copies out of our legacy allocation are waited for until the
  // channel's deadline once the connection closed, and past it while the
  // peer lives (teardownReady()): a dead peer's never complete, and the
  // record of them is all we have.
  std::vector<TeardownWait> waits;
  if (localUse_ != nullptr) {
    waits.push_back({localUse_, false});
  }
  if (ready_ != nullptr && (owner_ || peerThere)) {
    waits.push_back({ready_, false});
  }
  if (released_ != nullptr && peerThere) {
    waits.push_back({released_, false});
  } else if (released_ != nullptr && owner_ && legacy) {
    waits.push_back({released_, true});
  }
  return waits;
}

bool Block::teardownReady() const {
  CurrentDevice current(memory_->device());
  const auto now = std::chrono::steady_clock::now();
  bool patienceOver = now >= patience_;
  if (owner_ && orphaned_.load() && peer_ != nullptr && released_ != nullptr) {
    // A legacy block of ours whose importer we know. Past the deadline it
    // waits, while that process lives, for the peer's `released` (recorded
    // after its copies out), then as long again for the peer to close its
    // mapping and our events (its staging thread does so once its copy
    // ended). A live peer slow to copy out of it (its stream behind long
    // work, its process stopped) once read it after we freed it, and the
    // memory could be another allocation's by then. A dead peer's records
    // never complete: then the deadline alone holds, as before.
    using Clock = std::chrono::steady_clock;
    if (libcuda().cuEventQuery(released_) == CUDA_ERROR_NOT_READY) {
      // (Pending after it was seen done: a record made since the close.
      // One pending from the first look may be the frame before's.)
      releasedSeenPending_ =
          releasedSeenPending_ || releasedDoneAt_ != Clock::time_point{};
      releasedDoneAt_ = Clock::time_point{};
    } else if (releasedDoneAt_ == Clock::time_point{}) {
      releasedDoneAt_ = now;
    }
    if (patienceOver && !peer_->gone()) {
      const bool settled = releasedDoneAt_ != Clock::time_point{} &&
          now - releasedDoneAt_ >=
              std::chrono::milliseconds(kLegacyTeardownWaitMs);
      // Lent in a frame the peer had not released: it may not have read
      // it yet (its process stopped, its loop behind), and it still will,
      // the close notwithstanding (what came before a close is
      // delivered); until its copy out is seen queued (`released` seen
      // done, then pending), the block waits kLentAtCloseWaitMs more.
      // `released` as it was before that frame (done, or pending with the
      // frame before's copy) says nothing of it.
      const bool unread = lentAtClose_ && !releasedSeenPending_ &&
          now < patience_ + std::chrono::milliseconds(kLentAtCloseWaitMs);
      patienceOver = settled && !unread;
    }
  }
  if (owner_ && orphaned_.load() && !patienceOver) {
    // Ours, left by a close that no answer of the peer's settled (a block
    // it dropped and heard back of is never orphaned): its events are
    // interprocess, and the peer, if it lives, may still have them open,
    // to destroy as its own close retires its import. cuda.h leaves any
    // use of an opened event after its exporter destroyed it undefined,
    // so ours stay until the channel's deadline (and past it while a live
    // peer's copies may run, above), as a grant's events do (the fake
    // counted the other order as a poisoned use, now and then, when both
    // ends closed at once).
    return false;
  }
  for (const TeardownWait& w : teardownWaits()) {
    if (libcuda().cuEventQuery(w.event) == CUDA_ERROR_NOT_READY &&
        !(w.patient && patienceOver)) {
      return false;
    }
  }
  return true;
}

Block::~Block() {
  if (accounted_ != 0) {
    releaseIpc(memory_ ? memory_->device() : device_, accounted_);
  }
  if (memory_ == nullptr) {
    return; // making or importing it failed: nothing else was made
  }
  try {
    // retire() let it go once teardownReady(): nothing is waited for here
    // (a peer recording an event again now would hold the staging thread).
    CurrentDevice current(memory_->device());
    for (CUevent e : {ready_, released_, localUse_}) {
      if (e != nullptr) {
        libcuda().cuEventDestroy(e);
      }
    }
  } catch (const std::exception& e) {
    logWarning(
        std::string("torch_rpc_ext: freeing a cuda_ipc block: ") + e.what());
  }
  memory_.reset(); // unmapped before the owner hears (whenFreed)
  if (freed_) {
    try {
      freed_();
    } catch (const std::exception& e) {
      logWarning(
          std::string("torch_rpc_ext: after freeing a cuda_ipc block: ") +
          e.what());
    }
  }
}

std::string Block::describe(uint32_t id) const {
  BlockSetup s{};
  s.id = id;
  s.sharing = static_cast<uint32_t>(memory_->sharing());
  s.size = memory_->size();
  std::string uuid = deviceUuid(memory_->device());
  std::memcpy(
      s.deviceUuid, uuid.data(), std::min(uuid.size(), sizeof(s.deviceUuid)));
  CurrentDevice current(memory_->device());
  TORCH_RPC_EXT_CUDA_CHECK(cuIpcGetEventHandle, &s.ready, ready_);
  TORCH_RPC_EXT_CUDA_CHECK(cuIpcGetEventHandle, &s.released, released_);
  std::string head(reinterpret_cast<const char*>(&s), sizeof(s));
  if (memory_->sharing() == Sharing::kLegacy) {
    CUipcMemHandle h = memory_->legacyHandle();
    head.append(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  return head;
}

} // namespace torch_rpc_ext::channel::cuda
