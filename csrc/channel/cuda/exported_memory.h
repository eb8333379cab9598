// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace torch_rpc_ext::channel::cuda {

// How a block of device memory is shared with another process of the host.
enum class Sharing : uint32_t {
  // Made with cuMemCreate, exported once as a POSIX file descriptor that
  // travels over a Unix socket (as the shm channel's CPU memory does). The
  // physical memory lives until the last process unmaps it, whichever
  // created it: a peer's view stays valid after the owner frees its side,
  // closes the connection or exits.
  kFd = 0,
  // Made with cuMemAlloc, named by a legacy IPC handle (cuIpcGetMemHandle,
  // 64 bytes that travel in a frame), where a device cannot export a
  // descriptor. The memory is the owner's: it dies when the owner frees it
  // or exits, so a peer copies out of it rather than viewing it
  // (ipc_channel.h).
  kLegacy = 1,
};

// One block of device memory, mapped into this process, that another
// process on the host maps too: the owner exports it once, each peer imports
// and maps it once.
//
// All calls need no current context: each makes the device's primary
// context current for its own duration (device.h).
class ExportedMemory {
 public:
  // At least `bytes` on `device`, rounded up to the allocation granularity.
  // Throws naming the driver call on failure (out of memory, a device
  // without POSIX fd export: see supportsFdExport()).
  static std::unique_ptr<ExportedMemory> create(
      int device,
      size_t bytes,
      Sharing sharing = Sharing::kFd);
  // Maps a block another process exported: `fd` (not taken: the caller
  // closes it), `bytes` as that process's size(), on this process's
  // `device` (the index of the same physical device here).
  static std::unique_ptr<ExportedMemory> import(
      int fd,
      size_t bytes,
      int device);
  // Opens a block another process shared by a legacy handle.
  static std::unique_ptr<ExportedMemory> importLegacy(
      const CUipcMemHandle& handle,
      size_t bytes,
      int device);

  ~ExportedMemory();
  ExportedMemory(const ExportedMemory&) = delete;
  ExportedMemory& operator=(const ExportedMemory&) = delete;

  // A new descriptor for the memory (the caller owns it). Throws if the
  // block was imported (only its creator exports it) or is not kFd.
  int exportFd() const;
  // The legacy handle (kLegacy, ours only).
  CUipcMemHandle legacyHandle() const;

  CUdeviceptr address() const {
    return address_;
  }
  size_t size() const {
    return size_;
  }
  int device() const {
    return device_;
  }
  Sharing sharing() const {
    return sharing_;
  }

  // Opens the memory (kFd) to another device of this process too, which
  // then reads and writes it peer to peer (NVLink, PCIe): only where
  // canAccessPeer(device, this->device()) holds. Once per device; the
  // caller serialises calls (cuda_ipc: its loop thread).
  void grantAccess(int device);
  bool grantedTo(int device) const;

  // The granularity sizes are rounded up to on `device`.
  static size_t granularity(int device, Sharing sharing = Sharing::kFd);

 private:
  ExportedMemory(
      int device,
      size_t size,
      Sharing sharing,
      CUmemGenericAllocationHandle h,
      bool owner);
  // Reserves, maps and opens the whole block to this process's device;
  // `alignment`: the granularity (kFd).
  void map(size_t alignment);

  const int device_;
  const size_t size_;
  const Sharing sharing_;
  CUmemGenericAllocationHandle handle_;
  const bool owner_;
  CUdeviceptr address_ = 0;
  bool mapped_ = false;
  std::vector<int> peers_; // other devices granted access (grantAccess)
};

} // namespace torch_rpc_ext::channel::cuda
