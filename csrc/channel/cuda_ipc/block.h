// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "csrc/channel/cuda/exported_memory.h"
#include "csrc/common/process_watch.h"

namespace torch_rpc_ext::channel::cuda {

// The cuda_ipc channel's unit of memory (ipc_channel.h) and the frame that
// announces it to the peer (docs/wire-format.md, kind 32).
#pragma pack(push, 1)
struct BlockSetup {
  uint32_t id;
  uint32_t sharing; // Sharing: kFd (a descriptor rides with the frame) or
                    // kLegacy (a CUipcMemHandle follows this head)
  uint64_t size;
  char deviceUuid[32]; // hex digits, as deviceUuid()
  CUipcEventHandle ready;
  CUipcEventHandle released;
};
#pragma pack(pop)
static_assert(sizeof(BlockSetup) == 176, "BlockSetup layout is fixed");
// A kLegacy setup's head: the above, then the memory's handle.
constexpr size_t kLegacySetupBytes = sizeof(BlockSetup) + CU_IPC_HANDLE_SIZE;
static_assert(sizeof(CUipcMemHandle) == CU_IPC_HANDLE_SIZE);

// One device block and its two events, on either side: ours (created,
// exported) or the peer's (imported, events opened).
class Block {
 public:
  // Ours, on `device`, of at least `bytes`; null where cuda_ipc's bound on
  // the device's blocks, or the device's memory even after torch freed its
  // cache, does not allow it (device_memory.h: the segment is declined).
  static std::shared_ptr<Block> create(
      int device,
      uint64_t bytes,
      Sharing sharing);
  // The peer's, from its setup: kFd with `fd` (nothing taken: the caller
  // closes it), kLegacy with `legacy`.
  static std::shared_ptr<Block> import(
      const BlockSetup& setup,
      int fd,
      const CUipcMemHandle* legacy,
      int device);
  // Its shared_ptr's deleter: the block is freed on the staging thread
  // once the device work its teardown waits for has completed (polled:
  // never a blocking wait, on any thread; a block whose events never
  // complete stays, and is named in the log after kTeardownWarnAfter).
  static void retire(Block* b);
  static constexpr std::chrono::seconds kTeardownWarnAfter{10};
  ~Block();
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;

  int device() const {
    return memory_->device();
  }
  CUdeviceptr address() const {
    return memory_->address();
  }
  uint64_t size() const {
    return memory_->size();
  }
  Sharing sharing() const {
    return memory_->sharing();
  }
  // A peer's kFd block read from another device of ours, peer to peer
  // (ExportedMemory::grantAccess; loop thread).
  void grantAccess(int device) {
    memory_->grantAccess(device);
  }
  bool grantedTo(int device) const {
    return memory_->grantedTo(device);
  }
  // Setup frame head (ours only): BlockSetup, and for kLegacy the handle.
  std::string describe(uint32_t id) const;
  // A new descriptor (ours, kFd only).
  int exportFd() const {
    return memory_->exportFd();
  }
  CUevent ready() const {
    return ready_;
  }
  CUevent released() const {
    return released_;
  }
  // Recorded (here only) after this process's last use of the memory.
  CUevent localUse() const {
    return localUse_;
  }
  bool own() const {
    return owner_;
  }
  // The connection closed: the peer may be gone, with records of ours it
  // made that will never complete, and the events it exported destroyed.
  // From now on nothing waits for or records on the peer's side of it.
  // `patience`: until when freeing a legacy block waits for the copies out
  // of it still running (block.cpp); `peer`, if known: the process that
  // imported a legacy block of ours, whose copies out of it are waited for
  // past `patience` as long as it lives; `lent`: the block was in a frame
  // the peer had not released yet, which it may not even have read.
  void orphan(
      std::chrono::steady_clock::time_point patience,
      std::shared_ptr<const ProcessWatch> peer = nullptr,
      bool lent = false) {
    patience_ = patience;
    peer_ = std::move(peer);
    lentAtClose_ = lent;
    orphaned_.store(true);
  }
  bool orphaned() const {
    return orphaned_.load();
  }
  // Runs `fn` (on the staging thread) once the block is freed: its memory
  // unmapped and its events destroyed. Set before the last reference goes
  // (the importer answers a drop only then: the owner frees after).
  void whenFreed(std::function<void()> fn) {
    freed_ = std::move(fn);
  }

 private:
  Block() = default;
  // What the block waits for before it is freed (retire() polls them):
  // each event, and whether only until patience_.
  struct TeardownWait {
    CUevent event;
    bool patient;
  };
  std::vector<TeardownWait> teardownWaits() const;
  // Every wait of teardownWaits() is over (asked of the driver, no wait).
  bool teardownReady() const;
  std::unique_ptr<ExportedMemory> memory_;
  CUevent ready_ = nullptr;
  CUevent released_ = nullptr;
  CUevent localUse_ = nullptr;
  bool owner_ = false;
  int device_ = 0;
  uint64_t accounted_ = 0; // of cuda_ipc's bound (device_memory.h)
  std::atomic<bool> orphaned_{false};
  std::chrono::steady_clock::time_point patience_{};
  std::shared_ptr<const ProcessWatch> peer_; // set before orphaned_
  bool lentAtClose_ = false; // (likewise)
  // When `released` was last seen done after the close, and whether it was
  // seen pending after that (the staging thread's only: teardownReady()).
  mutable std::chrono::steady_clock::time_point releasedDoneAt_{};
  mutable bool releasedSeenPending_ = false;
  std::function<void()> freed_;
};

} // namespace torch_rpc_ext::channel::cuda
