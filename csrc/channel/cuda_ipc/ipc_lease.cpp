// SPDX-License-Identifier: BSD-3-Clause
// cuda_ipc's lease on a received block (ipc_lease.h).
#include "csrc/channel/cuda_ipc/ipc_lease.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/staging_pool.h"
#include "csrc/channel/cuda_ipc/ipc_channel.h"
#include "csrc/common/libcuda.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext::channel::cuda {

BlockLease::BlockLease(
    std::weak_ptr<IpcChannel> conn,
    std::shared_ptr<Block> block,
    uint32_t id,
    bool own,
    int target,
    std::shared_ptr<CUstream_st> join)
    : conn_(std::move(conn)),
      block_(std::move(block)),
      id_(id),
      own_(own),
      target_(target < 0 ? block_->device() : target),
      join_(std::move(join)) {
  if (target_ != block_->device() && !join_) {
    throw std::invalid_argument(
        "a lease read peer to peer needs a join stream of cuda:" +
        std::to_string(block_->device()));
  }
}

BlockLease::~BlockLease() {
  if (handedOn_.load()) {
    return; // the frame that passed it on recorded `released`
  }
  try {
    std::lock_guard<std::mutex> lock(mu_);
    if (!streams_.empty() && target_ != block_->device()) {
      // Read peer to peer: the uses are streams of `target_`, and the
      // block's events (of its own device) are recorded on a stream of the
      // block's device once they are done.
      PooledEvent used;
      {
        CurrentDevice current(target_);
        const auto last = reinterpret_cast<CUstream>(streams_.back());
        joinUsesLocked(last);
        used = StagingPool::of(target_).takeEvent();
        TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, used.get(), last);
      }
      // On the connection's own stream: this wait is on work that waited
      // on the peer's `ready`, so a peer that never completes it holds
      // this stream, and only its own blocks' releases behind it.
      CurrentDevice current(block_->device());
      const CUstream home = join_.get();
      TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, home, used.get(), 0);
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block_->localUse(), home);
      if (!block_->orphaned()) {
        TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block_->released(), home);
      }
    } else if (!streams_.empty()) {
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
    } else if (!own_ && join_ && !block_->orphaned()) {
      // Never waited on (its message did not land): no use of ours to
      // join, but the peer's next copy into the block waits on `released`
      // alone, so it must follow the peer's last copy into it, which may
      // still be queued behind the sender's work. (Before, nothing was
      // recorded: the next copy, on another stream, could run first.)
      CurrentDevice current(block_->device());
      const CUstream home = join_.get();
      TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, home, block_->ready(), 0);
      TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, block_->released(), home);
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
      c->releasePeerBlock(id_, block_->size());
    }
  }
}

void BlockLease::waitOn(uintptr_t stream) {
  // The segments of a frame packed into one block share this lease and its
  // one record: a stream waits on it once (1000 tensors: one wait).
  std::lock_guard<std::mutex> lock(mu_);
  if (std::find(waited_.begin(), waited_.end(), stream) != waited_.end()) {
    return;
  }
  CurrentDevice current(target_);
  // A block the peer filled is ready at its `ready` record; one of ours
  // it handed back, at its `released` record.
  TORCH_RPC_EXT_CUDA_CHECK(
      cuStreamWaitEvent,
      reinterpret_cast<CUstream>(stream),
      own_ ? block_->released() : block_->ready(),
      0);
  waited_.push_back(stream);
  if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) {
    streams_.push_back(stream);
  }
}

void BlockLease::recordUse(uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) {
    streams_.push_back(stream);
  }
}

void BlockLease::joinUses(CUstream into) {
  std::lock_guard<std::mutex> lock(mu_);
  joinUsesLocked(into);
}

bool BlockLease::isOf(const IpcChannel* channel) const {
  return conn_.lock().get() == channel;
}

void BlockLease::joinUsesLocked(CUstream into) {
  for (uintptr_t s : streams_) {
    const auto other = reinterpret_cast<CUstream>(s);
    if (other == into) {
      continue;
    }
    // A pooled event (the streams are `target_`'s): the wait binds the
    // record made just before it, so the event may be recorded again by
    // its next taker at once (no create and destroy a lease).
    const PooledEvent e = StagingPool::of(target_).takeEvent();
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, e.get(), other);
    TORCH_RPC_EXT_CUDA_CHECK(cuStreamWaitEvent, into, e.get(), 0);
  }
}

} // namespace torch_rpc_ext::channel::cuda
