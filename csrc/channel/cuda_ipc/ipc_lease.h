// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "csrc/channel/channel.h"
#include "csrc/channel/cuda_ipc/block.h"

namespace torch_rpc_ext::channel::cuda {

class IpcChannel;

// A received segment's memory: a span of a block, valid while this lives.
// The segments of one frame that the sender packed into one block share
// one lease. When it dies, the block goes back to its owner once the work
// queued by then on every stream it was used on has finished (the
// `released` event).
class BlockLease final : public DeviceRegion {
 public:
  // `target`: the device that reads the memory, where not the block's own
  // (peer to peer: Block::grantAccess done); its streams are the uses.
  // Then `join`, a stream of the block's device owned by the connection the
  // block came through, is where its events are recorded after those uses
  // (IpcChannel::joinStream: a peer whose records never complete stalls
  // its own connection's releases only, not every peer's). A peer's block
  // has one anyway: a lease that dies unused records its release there.
  BlockLease(
      std::weak_ptr<IpcChannel> conn,
      std::shared_ptr<Block> block,
      uint32_t id,
      bool own,
      int target = -1,
      std::shared_ptr<CUstream_st> join = nullptr);
  ~BlockLease() override;

  // The device the receiver's tensors are on: the block's, or the one
  // that reads it peer to peer.
  int device() const override {
    return target_;
  }
  void waitOn(uintptr_t stream) override;

  // The memory is read or written on `stream` too (a copy of it sent on).
  void recordUse(uintptr_t stream) override;
  // Makes `into` wait for the work queued so far on every other stream the
  // memory was used on.
  void joinUses(CUstream into);

  // Whether this lease came from `channel` (a live one: a new channel may
  // sit at a closed one's address).
  bool isOf(const IpcChannel* channel) const;

  const Block& block() const {
    return *block_;
  }
  uint32_t id() const {
    return id_;
  }
  bool own() const {
    return own_;
  }
  // Another segment of the frame views the same block: the block can no
  // longer be handed back whole by one of them.
  void share() {
    shared_.store(true);
  }
  bool shared() const {
    return shared_.load();
  }
  bool handOn() {
    return !handedOn_.exchange(true);
  }
  // Handed back to its owner, which may lend the block again meanwhile.
  bool handedOn() const {
    return handedOn_.load();
  }
  // That frame was not sent after all: the lease gives the block back
  // itself (the records the hand-back made only order more work).
  void keep() {
    handedOn_.store(false);
  }

 private:
  void joinUsesLocked(CUstream into);

  std::weak_ptr<IpcChannel> conn_;
  std::shared_ptr<Block> block_;
  uint32_t id_;
  bool own_;
  const int target_;
  const std::shared_ptr<CUstream_st> join_; // a peer's block's
  std::mutex mu_;
  std::vector<uintptr_t> streams_; // of device(), in first-use order
  std::vector<uintptr_t> waited_; // streams that waited on the block's record
  std::atomic<bool> shared_{false};
  std::atomic<bool> handedOn_{false};
};

} // namespace torch_rpc_ext::channel::cuda
