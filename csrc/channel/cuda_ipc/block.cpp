// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/cuda_ipc/block.h"

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "csrc/channel/cuda/device.h"
#include "csrc/channel/cuda/device_memory.h"
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
  std::shared_ptr<Block> b(new Block());
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
  std::shared_ptr<Block> b(new Block());
  b->memory_ = legacy != nullptr
      ? ExportedMemory::importLegacy(*legacy, setup.size, device)
      : ExportedMemory::import(fd, setup.size, device);
  CurrentDevice current(device);
  TORCH_RPC_EXT_CUDA_CHECK(cuIpcOpenEventHandle, &b->ready_, setup.ready);
  TORCH_RPC_EXT_CUDA_CHECK(cuIpcOpenEventHandle, &b->released_, setup.released);
  TORCH_RPC_EXT_CUDA_CHECK(
      cuEventCreate, &b->localUse_, CU_EVENT_DISABLE_TIMING);
  return b;
}

Block::~Block() {
  if (accounted_ != 0) {
    releaseIpc(memory_ ? memory_->device() : device_, accounted_);
  }
  if (memory_ == nullptr) {
    return; // making or importing it failed: nothing else was made
  }
  try {
    CurrentDevice current(memory_->device());
    // Unmapping under a copy or a kernel still reading it would fault the
    // device: wait for the last records (teardown only; a block is never
    // freed on an RPC's path): ours, and the peer's while it is there (a
    // peer gone may have left records that never complete; our own last use
    // of its memory was waited for when its lease died).
    const bool peerThere = !orphaned_.load();
    const bool legacy = sharing() == Sharing::kLegacy;
    // A legacy block is read by the peer's copies out of our allocation,
    // and ours out of the peer's: after the connection closed, wait for
    // those until the channel's deadline (they may have been queued behind
    // a dead peer's record, which never completes), not for ever.
    auto waitAWhile = [this](CUevent e) {
      while (libcuda().cuEventQuery(e) == CUDA_ERROR_NOT_READY &&
             std::chrono::steady_clock::now() < patience_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    };
    if (localUse_ != nullptr) {
      if (legacy && !owner_ && !peerThere) {
        waitAWhile(localUse_);
      } else {
        libcuda().cuEventSynchronize(localUse_);
      }
    }
    if (ready_ != nullptr && (owner_ || peerThere)) {
      libcuda().cuEventSynchronize(ready_);
    }
    if (released_ != nullptr && peerThere) {
      libcuda().cuEventSynchronize(released_);
    } else if (released_ != nullptr && owner_ && legacy) {
      waitAWhile(released_);
    }
    for (CUevent e : {ready_, released_, localUse_}) {
      if (e != nullptr) {
        libcuda().cuEventDestroy(e);
      }
    }
  } catch (const std::exception& e) {
    logWarning(
        std::string("torch_rpc_ext: freeing a cuda_ipc block: ") + e.what());
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
