// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <cstddef>
#include <memory>

namespace torch_rpc_ext::channel::cuda {

// One block of device memory made with cuMemCreate, mapped into this
// process, that other processes on the host map too: the owner exports it
// once as a POSIX file descriptor, which travels over a Unix socket (as the
// shm channel's CPU memory does), and each peer imports and maps it once.
// The physical memory lives until the last process unmaps it, whichever
// created it: a peer's view stays valid after the owner frees its side,
// closes the connection or exits.
//
// All calls need no current context: each makes the device's primary
// context current for its own duration (device.h).
class ExportedMemory {
 public:
  // At least `bytes` on `device`, rounded up to the allocation granularity.
  // Throws naming the driver call on failure (out of memory, a device
  // without POSIX fd export: see supportsFdExport()).
  static std::unique_ptr<ExportedMemory> create(int device, size_t bytes);
  // Maps a block another process exported: `fd` (not taken: the caller
  // closes it), `bytes` as that process's size(), on this process's
  // `device` (the index of the same physical device here).
  static std::unique_ptr<ExportedMemory> import(
      int fd,
      size_t bytes,
      int device);

  ~ExportedMemory();
  ExportedMemory(const ExportedMemory&) = delete;
  ExportedMemory& operator=(const ExportedMemory&) = delete;

  // A new descriptor for the memory (the caller owns it). Throws if the
  // block was imported (only its creator exports it).
  int exportFd() const;

  CUdeviceptr address() const {
    return address_;
  }
  size_t size() const {
    return size_;
  }
  int device() const {
    return device_;
  }

  // The granularity sizes are rounded up to on `device`.
  static size_t granularity(int device);

 private:
  ExportedMemory(
      int device,
      size_t size,
      CUmemGenericAllocationHandle h,
      bool owner);
  // Reserves, maps and opens the whole block to this process's device;
  // `alignment`: the granularity.
  void map(size_t alignment);

  const int device_;
  const size_t size_;
  CUmemGenericAllocationHandle handle_;
  const bool owner_;
  CUdeviceptr address_ = 0;
  bool mapped_ = false;
};

} // namespace torch_rpc_ext::channel::cuda
