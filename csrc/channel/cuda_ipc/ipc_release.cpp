// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc: giving the peer's blocks back, batched to ride with our next
// frame (ipc_channel.h, kDeferredReleaseBytes); dropping our idle ones
// (trim(), on the connection's tick); and at a graceful shutdown every
// block back before the connection closes (settleFromLoop()).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/channel/lending.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::channel::cuda {

namespace {
std::atomic<int64_t> g_releaseRideMs{kReleaseRideMs};

int64_t steadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
} // namespace

void setReleaseRideMs(int64_t ms) {
  g_releaseRideMs.store(ms, std::memory_order_relaxed);
}

int64_t releaseRideMs() {
  return g_releaseRideMs.load(std::memory_order_relaxed);
}

void IpcChannel::releasePeerBlock(uint32_t id, uint64_t bytes) {
  auto host = host_.lock();
  if (!host || host->isClosed()) {
    return; // nobody left to tell
  }
  const int64_t ride = releaseRideMs();
  // Settling for a shutdown: no frame of ours will come for it to ride.
  bool now = bytes > kDeferredReleaseBytes || ride == 0 ||
      settlingSinceNs_.load(std::memory_order_relaxed) != 0;
  bool arm = false;
  {
    std::lock_guard<std::mutex> lock(releaseMutex_);
    if (pendingReleases_.empty()) {
      batchSince_ = std::chrono::steady_clock::now();
    }
    pendingReleases_ += idHead(id);
    now = now ||
        pendingReleases_.size() >= kMaxPendingReleases * sizeof(uint32_t);
    // One timer at a time: it re-arms itself for a younger batch.
    arm = !now && !rideArmed_;
    rideArmed_ = rideArmed_ || arm;
  }
  counters_.releases.fetch_add(1, std::memory_order_relaxed);
  if (now) {
    flushReleases();
  } else if (arm) {
    armRide(*host, std::chrono::milliseconds(ride));
  }
}

void IpcChannel::armRide(Host& host, std::chrono::milliseconds after) {
  // No frame of ours within the ride's wait (a slow function, a one-way
  // burst): the releases go on their own, so the owner's blocks are not
  // held for a tick.
  std::weak_ptr<IpcChannel> weak = shared_from_this();
  host.postAfter(after, [weak] {
    auto self = weak.lock();
    if (!self) {
      return;
    }
    auto host = self->host_.lock();
    const auto ride = std::chrono::milliseconds(releaseRideMs());
    std::chrono::milliseconds left{0};
    {
      std::lock_guard<std::mutex> lock(self->releaseMutex_);
      if (self->pendingReleases_.empty()) {
        self->rideArmed_ = false; // a frame took them
        return;
      }
      const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - self->batchSince_);
      if (age < ride && host) {
        left = ride - age; // a younger batch than the one armed for
      } else {
        self->rideArmed_ = false;
      }
    }
    if (left.count() > 0) {
      self->armRide(*host, left);
    } else {
      self->flushReleases();
    }
  });
}

void IpcChannel::flushReleases() {
  auto host = host_.lock();
  if (!host || host->isClosed()) {
    return;
  }
  // Taken under the connection's write lock (collectPendingLocked), as a
  // frame's ride takes them: a frame sent after this goes after them.
  host->sendPendingControl();
}

void IpcChannel::collectPendingLocked(std::vector<ControlFrame>* out) {
  collectGrantsLocked(out); // grants ride as releases do
  // Releases waiting for a ride take this one.
  std::lock_guard<std::mutex> lock(releaseMutex_);
  if (!pendingReleases_.empty()) {
    counters_.releaseFrames.fetch_add(1, std::memory_order_relaxed);
    out->push_back(
        ControlFrame{
            context().wireIds().kind(kBlockRelease),
            std::move(pendingReleases_),
            {},
            {}});
    pendingReleases_.clear();
  }
}

void IpcChannel::settleFromLoop() {
  // Our releases go now, not with a frame that will not come; our free
  // blocks are dropped now, not after kBlockIdleMs: the peer closes its
  // imports of them and answers, and only then are they freed. Otherwise
  // the connection's close frees ours while the peer's imports are open,
  // and the peer closes them after (the events an exporter destroyed, the
  // memory it freed), which cuda.h calls undefined. Repeated every
  // kSettleStepMs: blocks whose device work is still running, and blocks
  // the peer releases meanwhile, are dropped as they come.
  // A settle asked again while one runs goes on with it; one asked after
  // an earlier ended (a shutdown that failed and was retried) starts anew.
  int64_t zero = 0;
  settlingSinceNs_.compare_exchange_strong(zero, steadyNs());
  if (!settleStepArmed_) {
    settleStep();
  }
}

void IpcChannel::settleStep() {
  settleStepArmed_ = false;
  auto host = host_.lock();
  if (!host || host->isClosed()) {
    settlingSinceNs_.store(0);
    return;
  }
  flushReleases();
  closeDropped();
  trim(std::chrono::milliseconds(0));
  const int64_t since = settlingSinceNs_.load();
  if (settled() || steadyNs() - since > kSettleForMs * 1000000) {
    // Over: releases ride with frames again, and settled() says so.
    settlingSinceNs_.store(0);
    return;
  }
  settleStepArmed_ = true;
  std::weak_ptr<IpcChannel> weak = shared_from_this();
  host->postAfter(std::chrono::milliseconds(kSettleStepMs), [weak] {
    if (auto self = weak.lock()) {
      self->settleStep();
    }
  });
}

bool IpcChannel::settled() {
  const int64_t since = settlingSinceNs_.load();
  auto host = host_.lock();
  if (since == 0 || !host || host->isClosed()) {
    return true; // not asked to, over, or nobody left to answer
  }
  const bool lentWaitOver = steadyNs() - since > kSettleLentMs * 1000000;
  std::lock_guard<std::mutex> lock(mu_);
  return std::none_of(ownBlocks_.begin(), ownBlocks_.end(), [&](auto& kv) {
    switch (kv.second.state) {
      case OwnBlock::State::kFree:
      case OwnBlock::State::kDropping:
        return true;
      default: // kLent, kLocal: a user's tensor may hold it (a zero-copy
               // view, the peer's or, handed back, ours)
        return !lentWaitOver;
    }
  });
}

void IpcChannel::onTickFromLoop() {
  // Blocks go back once traffic stops: releases still waiting for a frame.
  revokeIdleGrantsFromLoop(); // (before: its revokes go with the releases)
  flushReleases();
  closeDropped();
  trim(std::chrono::milliseconds(kBlockIdleMs));
}

void IpcChannel::trim(std::chrono::milliseconds idleFor) {
  // Free blocks idle for `idleFor` whose events have completed (so that
  // unmapping one never waits on the loop thread for the GPU, ours or the
  // peer's), asked outside the lock.
  struct Idle {
    uint32_t id;
    std::shared_ptr<Block> block;
    std::chrono::steady_clock::time_point lastUsed;
  };
  std::vector<Idle> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto now = std::chrono::steady_clock::now();
    for (auto& [id, own] : ownBlocks_) {
      // Not before its setup is out: the drop goes ahead of queued frames
      // (sendControl), and the peer would read the drop of a block it never
      // heard of (a frame refused at send frees a new block while its setup
      // waits behind a peer that stopped reading; session 94, as shm_slab).
      if (own.state == OwnBlock::State::kFree && own.announced->load() &&
          now - own.lastUsed >= idleFor) {
        idle.push_back(Idle{id, own.block, own.lastUsed});
      }
    }
  }
  if (idle.empty()) {
    return;
  }
  std::vector<Idle> quiet;
  for (auto& b : idle) {
    CurrentDevice current(b.block->device());
    if (libcuda().cuEventQuery(b.block->ready()) == CUDA_SUCCESS &&
        libcuda().cuEventQuery(b.block->released()) == CUDA_SUCCESS &&
        libcuda().cuEventQuery(b.block->localUse()) == CUDA_SUCCESS) {
      quiet.push_back(std::move(b));
    }
  }
  idle.clear();
  // Kept until the peer answers that it closed them (kBlockDropped).
  std::vector<uint32_t> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Idle& q : quiet) {
      // Still free and unused since its events were asked: not lent,
      // used and given back meanwhile (its new work unasked).
      auto it = ownBlocks_.find(q.id);
      if (it != ownBlocks_.end() &&
          it->second.state == OwnBlock::State::kFree &&
          it->second.lastUsed == q.lastUsed) {
        dropped.push_back(q.id);
        it->second.state = OwnBlock::State::kDropping;
      }
    }
  }
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

} // namespace torch_rpc_ext::channel::cuda
