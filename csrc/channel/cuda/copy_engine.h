// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace torch_rpc_ext::channel::cuda {

// One compiled copy kernel as torch_rpc_ext._cuda.ptx.kernel_ptx() makes it:
// the PTX text and the mangled entry name to look up in it.
struct KernelImage {
  std::string entry;
  std::string ptx;
};
// By kernel name ("copy_contiguous", "copy_segments", "pack_strided",
// "unpack_strided": torch_rpc_ext/_cuda/abi.py).
using KernelImages = std::map<std::string, KernelImage>;

// The copy kernels of one device, launched on the caller's streams with no
// Python, no GIL and no host waiting: every method enqueues and returns.
// Descriptor tables travel to the device through pinned staging that is
// reused only once the launch that read it has completed (an event per
// staging buffer, queried, never waited on). Thread-safe.
// The newest PTX ISA (major * 10 + minor: 90 for 9.0) that a driver of
// `driverVersion` (cuDriverGetVersion: 12040 for CUDA 12.4) loads; 0 for
// one older than CUDA 9.0; -1 for one newer than the table (not checked).
int maxPtxIsa(int driverVersion);
// The ISA a PTX text declares (".version 6.0": 60), or -1 without one.
int ptxIsa(const std::string& ptx);

class CopyEngine {
 public:
  // Loads the kernels into `device`'s primary context. Throws if a kernel
  // is missing from `images` or the driver refuses its PTX (too new an ISA
  // for the driver: CUDA_ERROR_UNSUPPORTED_PTX_VERSION).
  CopyEngine(int device, const KernelImages& images);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  int device() const {
    return device_;
  }

  // `nbytes` from src to dst, any alignment: copy_contiguous, or from
  // kDriverCopyMinBytes on the driver's own copy (cuMemcpyAsync).
  void copy(CUstream stream, CUdeviceptr dst, CUdeviceptr src, uint64_t nbytes);
  // A plain copy this long goes to the driver: on an H200 its copy moved
  // 400 MB in 200-201 us where copy_contiguous took 216 (7% slower, in each
  // of four GPU runs, tools/gpu_probe.py; docs/performance.md). Below, the
  // two were level within what the probe could tell (their host side).
  static constexpr uint64_t kDriverCopyMinBytes = uint64_t(8) << 20;
  // copy_contiguous whatever the length (what copy() makes below
  // kDriverCopyMinBytes): for the probe, which times the two side by side.
  void copyKernel(
      CUstream stream,
      CUdeviceptr dst,
      CUdeviceptr src,
      uint64_t nbytes);

  // Many copies in one launch (the tensors of one message into or out of a
  // staging block).
  struct Segment {
    CUdeviceptr dst;
    CUdeviceptr src;
    uint64_t nbytes;
  };
  void copySegments(CUstream stream, const std::vector<Segment>& segments);

  // A strided view (sizes and strides in elements, torch's convention, none
  // negative) to and from a contiguous buffer in row-major order. Dimensions
  // that are contiguous with each other are merged first; a view that turns
  // out contiguous is one plain copy, one of rows contiguous inside of at
  // least kRowCopyMinBytes (two dimensions after merging, the inner of
  // stride 1) one pitched copy (cuMemcpy2DAsync), any other the strided
  // kernel.
  void pack(
      CUstream stream,
      CUdeviceptr contiguousDst,
      CUdeviceptr stridedSrc,
      const std::vector<int64_t>& sizes,
      const std::vector<int64_t>& strides,
      size_t elemSize);
  void unpack(
      CUstream stream,
      CUdeviceptr stridedDst,
      CUdeviceptr contiguousSrc,
      const std::vector<int64_t>& sizes,
      const std::vector<int64_t>& strides,
      size_t elemSize);

  // Rows at least this long go by one pitched copy (above).
  static constexpr uint64_t kRowCopyMinBytes = 512;
  // The largest pitch a pitched copy takes (CU_DEVICE_ATTRIBUTE_MAX_PITCH
  // is 2^31 - 1 on every current GPU); wider strides go by the kernel.
  static constexpr uint64_t kMaxRowPitch = (uint64_t(1) << 31) - 1;

  // Kernel launches so far, by kernel name, "row_copies": the pitched
  // copies made in their place, and "driver_copies": the plain copies
  // made by the driver (kDriverCopyMinBytes).
  std::map<std::string, uint64_t> launches() const;
  // Pinned staging buffers made so far (each reused once its launch is done).
  size_t stagingBuffers() const;

  // The merged (size, stride) dimensions of a view, outermost first, with
  // size-1 dimensions dropped: what the strided kernels get. Public for
  // tests.
  static std::vector<std::pair<int64_t, int64_t>> mergeDims(
      const std::vector<int64_t>& sizes,
      const std::vector<int64_t>& strides);

 private:
  enum Kernel { kCopy, kSegments, kPack, kUnpack, kNumKernels };
  // Freed by its destructor (with the engine's device current), after
  // waiting for `done`: only at teardown.
  struct Staging {
    ~Staging();
    void* host = nullptr; // pinned
    CUdeviceptr device = 0;
    size_t capacity = 0;
    CUevent done = nullptr; // recorded after the launch that read it
    bool claimed = false; // between acquire and the record of `done`
  };
  void loadKernels(const KernelImages& images);
  void unloadModules() noexcept;

  void launch(
      Kernel k,
      CUstream stream,
      uint64_t blocks,
      uint64_t a,
      uint64_t b,
      uint64_t c);
  // Copies `words` to the device on `stream`, runs `then(deviceAddress)`,
  // then marks the staging reusable once the stream passes that point.
  template <typename Then>
  void withTable(
      CUstream stream,
      const std::vector<uint64_t>& words,
      Then then);
  void strided(
      Kernel k,
      CUstream stream,
      CUdeviceptr dst,
      CUdeviceptr src,
      const std::vector<int64_t>& sizes,
      const std::vector<int64_t>& strides,
      size_t elemSize);

  const int device_;
  uint64_t maxBlocks_ = 0;
  CUmodule modules_[kNumKernels] = {};
  CUfunction functions_[kNumKernels] = {};
  std::atomic<uint64_t> launches_[kNumKernels] = {};
  std::atomic<uint64_t> rowCopies_{0};
  std::atomic<uint64_t> driverCopies_{0};
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Staging>> staging_;
};

} // namespace torch_rpc_ext::channel::cuda
