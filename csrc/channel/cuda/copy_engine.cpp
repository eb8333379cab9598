// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/cuda/copy_engine.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <stdexcept>

#include "csrc/channel/cuda/device.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

// In torch_rpc_ext/_cuda/abi.py's KERNELS order.
constexpr const char* kNames[] = {
    "copy_contiguous",
    "copy_segments",
    "pack_strided",
    "unpack_strided"};
constexpr uint64_t kThreads = 256;
// Each thread of a contiguous copy moves at least this many 16-byte vectors
// before another block is worth launching.
constexpr uint64_t kVectorsPerThread = 4;
// The most bytes of one row a copy_segments block copies at a time: a
// multiple of 16 (the vector path), small enough that a message of one big
// tensor still spreads over every multiprocessor.
constexpr uint64_t kChunkBytes = 64 << 10;
constexpr uint64_t kSegmentRowWords = 4; // abi.SEGMENT_ROW_WORDS
constexpr size_t kMinStaging = 4096;

std::string loadHint(CUresult rc) {
  switch (rc) {
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
      return ": its PTX ISA is newer than this driver accepts (pin "
             "nvidia-nvvm to the driver's CUDA version; docs/cuda.md)";
    case CUDA_ERROR_JIT_COMPILER_NOT_FOUND:
    case CUDA_ERROR_INVALID_PTX:
      return ": the driver could not JIT-compile PTX (a container without "
             "the driver's PTX compiler, libnvidia-ptxjitcompiler.so)";
    default:
      return "";
  }
}

uint64_t ceilDiv(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}

std::string isaText(int isa) {
  return std::to_string(isa / 10) + "." + std::to_string(isa % 10);
}

std::string cudaText(int driverVersion) {
  return std::to_string(driverVersion / 1000) + "." +
      std::to_string(driverVersion % 1000 / 10);
}

} // namespace

int maxPtxIsa(int driverVersion) {
  // CUDA release -> the PTX ISA it introduced (the PTX ISA notes).
  static constexpr std::pair<int, int> kTable[] = {
      {9000, 60},  {9010, 61},  {9020, 62},  {10000, 63}, {10010, 64},
      {10020, 65}, {11000, 70}, {11010, 71}, {11020, 72}, {11030, 73},
      {11040, 74}, {11050, 75}, {11060, 76}, {11070, 77}, {11080, 78},
      {12000, 80}, {12010, 81}, {12020, 82}, {12030, 83}, {12040, 84},
      {12050, 85}, {12060, 85}, {12080, 87}, {12090, 88}, {13000, 90}};
  if (driverVersion > kTable[std::size(kTable) - 1].first + 9) {
    return -1; // newer than we know: the driver decides
  }
  int isa = 0;
  for (const auto& [version, max] : kTable) {
    if (driverVersion >= version) {
      isa = max;
    }
  }
  return isa;
}

int ptxIsa(const std::string& ptx) {
  for (size_t at = ptx.find(".version"); at != std::string::npos;
       at = ptx.find(".version", at + 1)) {
    const size_t line = ptx.rfind('\n', at);
    const size_t start = line == std::string::npos ? 0 : line + 1;
    if (ptx.find_first_not_of(" \t", start) != at) {
      continue; // in a comment or a string
    }
    int major = 0, minor = 0;
    if (std::sscanf(ptx.c_str() + at + 8, " %d.%d", &major, &minor) == 2) {
      return major * 10 + minor;
    }
  }
  return -1;
}

CopyEngine::CopyEngine(int device, const KernelImages& images)
    : device_(device) {
  CurrentDevice current(device);
  // Enough blocks to fill every multiprocessor several times over; kernels
  // stride over what is left.
  maxBlocks_ = static_cast<uint64_t>(multiprocessors(device)) * 8;
  try {
    loadKernels(images);
  } catch (...) {
    unloadModules();
    throw;
  }
}

void CopyEngine::loadKernels(const KernelImages& images) {
  for (int k = 0; k < kNumKernels; ++k) {
    auto it = images.find(kNames[k]);
    if (it == images.end()) {
      throw std::invalid_argument(
          std::string("copy kernel '") + kNames[k] + "' missing from the PTX");
    }
    std::string text = it->second.ptx; // NUL-terminated by std::string
    // A clear error before the driver's: PTX newer than it loads (as NVVM
    // 13's, ISA 9.0, on a driver older than CUDA 13.0).
    const int isa = ptxIsa(text);
    const int driver = libcuda().driverVersion;
    const int most = maxPtxIsa(driver);
    if (isa > 0 && most >= 0 && isa > most) {
      throw std::runtime_error(
          std::string("the copy kernel ") + kNames[k] + "'s PTX is ISA " +
          isaText(isa) + ", newer than this CUDA " + cudaText(driver) +
          " driver loads (ISA " + isaText(most) +
          " at most): use the PTX torch_rpc_ext ships (ISA 6.0; unset "
          "TORCH_RPC_EXT_PTX) or a newer driver");
    }
    CUresult rc = libcuda().cuModuleLoadData(&modules_[k], text.c_str());
    if (rc != CUDA_SUCCESS) {
      throw std::runtime_error(
          cudaErrorText("cuModuleLoadData", rc) + " loading the copy kernel " +
          kNames[k] + loadHint(rc));
    }
    TORCH_RPC_EXT_CUDA_CHECK(
        cuModuleGetFunction,
        &functions_[k],
        modules_[k],
        it->second.entry.c_str());
  }
}

CopyEngine::~CopyEngine() {
  try {
    CurrentDevice current(device_);
    staging_.clear();
    unloadModules();
  } catch (const std::exception&) {
    // The driver is gone (process exit).
  }
}

void CopyEngine::unloadModules() noexcept {
  for (CUmodule& m : modules_) {
    if (m != nullptr) {
      libcuda().cuModuleUnload(m);
      m = nullptr;
    }
  }
}

CopyEngine::Staging::~Staging() {
  const Libcuda& cu = libcuda(); // made only once the driver had loaded
  if (done != nullptr) {
    // A launch still reading it would read freed memory.
    cu.cuEventSynchronize(done);
    cu.cuEventDestroy(done);
  }
  if (device != 0) {
    cu.cuMemFree(device);
  }
  if (host != nullptr) {
    cu.cuMemFreeHost(host);
  }
}

void CopyEngine::launch(
    Kernel k,
    CUstream stream,
    uint64_t blocks,
    uint64_t a,
    uint64_t b,
    uint64_t c) {
  void* args[] = {&a, &b, &c};
  const auto grid =
      static_cast<unsigned>(std::clamp<uint64_t>(blocks, 1, maxBlocks_));
  TORCH_RPC_EXT_CUDA_CHECK(
      cuLaunchKernel,
      functions_[k],
      grid,
      1,
      1,
      static_cast<unsigned>(kThreads),
      1,
      1,
      0,
      stream,
      args,
      nullptr);
  launches_[k].fetch_add(1, std::memory_order_relaxed);
}

void CopyEngine::copy(
    CUstream stream,
    CUdeviceptr dst,
    CUdeviceptr src,
    uint64_t nbytes) {
  if (nbytes >= kDriverCopyMinBytes) {
    CurrentDevice current(device_);
    TORCH_RPC_EXT_CUDA_CHECK(cuMemcpyAsync, dst, src, nbytes, stream);
    driverCopies_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  copyKernel(stream, dst, src, nbytes);
}

void CopyEngine::copyKernel(
    CUstream stream,
    CUdeviceptr dst,
    CUdeviceptr src,
    uint64_t nbytes) {
  if (nbytes == 0) {
    return;
  }
  CurrentDevice current(device_);
  launch(
      kCopy,
      stream,
      ceilDiv(ceilDiv(nbytes, 16), kThreads * kVectorsPerThread),
      dst,
      src,
      nbytes);
}

template <typename Then>
void CopyEngine::withTable(
    CUstream stream,
    const std::vector<uint64_t>& words,
    Then then) {
  const Libcuda& cu = libcuda();
  RelaxedCapture relaxed; // its staging queries (device.h)
  const size_t bytes = words.size() * sizeof(uint64_t);
  Staging* slot = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : staging_) {
      if (!s->claimed && s->capacity >= bytes &&
          cu.cuEventQuery(s->done) == CUDA_SUCCESS) {
        slot = s.get();
        break;
      }
    }
    if (slot == nullptr) {
      // Every buffer is in flight (or too small): one more, so no thread
      // ever waits for the GPU here. Their number is bounded by the
      // launches in flight at once.
      auto s = std::make_unique<Staging>();
      s->capacity = std::max(kMinStaging, std::bit_ceil(bytes));
      TORCH_RPC_EXT_CUDA_CHECK(cuMemHostAlloc, &s->host, s->capacity, 0);
      TORCH_RPC_EXT_CUDA_CHECK(cuMemAlloc, &s->device, s->capacity);
      TORCH_RPC_EXT_CUDA_CHECK(
          cuEventCreate, &s->done, CU_EVENT_DISABLE_TIMING);
      staging_.push_back(std::move(s));
      slot = staging_.back().get();
    }
    slot->claimed = true;
  }
  std::memcpy(slot->host, words.data(), bytes);
  try {
    TORCH_RPC_EXT_CUDA_CHECK(
        cuMemcpyHtoDAsync, slot->device, slot->host, bytes, stream);
    then(slot->device);
    TORCH_RPC_EXT_CUDA_CHECK(cuEventRecord, slot->done, stream);
  } catch (...) {
    // What was enqueued may still read it: reusable once the stream passes
    // this point, if that can be recorded; else never again.
    bool recorded = cu.cuEventRecord(slot->done, stream) == CUDA_SUCCESS;
    std::lock_guard<std::mutex> lock(mu_);
    if (!recorded) {
      slot->capacity = 0;
    }
    slot->claimed = false;
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  slot->claimed = false;
}

void CopyEngine::copySegments(
    CUstream stream,
    const std::vector<Segment>& segments) {
  std::vector<uint64_t> table;
  table.reserve(segments.size() * kSegmentRowWords);
  uint64_t chunks = 0;
  for (const Segment& s : segments) {
    if (s.nbytes == 0) {
      continue; // copies nothing; keeps the table short
    }
    table.insert(table.end(), {s.dst, s.src, s.nbytes, chunks});
    chunks += ceilDiv(s.nbytes, kChunkBytes);
  }
  if (chunks == 0) {
    return;
  }
  if (table.size() == kSegmentRowWords) {
    copy(stream, table[0], table[1], table[2]);
    return;
  }
  CurrentDevice current(device_);
  const uint64_t rows = table.size() / kSegmentRowWords;
  withTable(stream, table, [&](CUdeviceptr device) {
    launch(kSegments, stream, chunks, device, rows, kChunkBytes);
  });
}

std::vector<std::pair<int64_t, int64_t>> CopyEngine::mergeDims(
    const std::vector<int64_t>& sizes,
    const std::vector<int64_t>& strides) {
  if (sizes.size() != strides.size()) {
    throw std::invalid_argument("a view's sizes and strides differ in length");
  }
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] < 0 || strides[d] < 0) {
      throw std::invalid_argument("a view with a negative size or stride");
    }
    if (sizes[d] == 0) {
      return {{0, 1}};
    }
    if (sizes[d] == 1) {
      continue;
    }
    // The outer dimension steps over whole runs of this one: one dimension.
    if (!dims.empty() && dims.back().second == sizes[d] * strides[d]) {
      dims.back() = {dims.back().first * sizes[d], strides[d]};
    } else {
      dims.emplace_back(sizes[d], strides[d]);
    }
  }
  return dims;
}

void CopyEngine::strided(
    Kernel k,
    CUstream stream,
    CUdeviceptr dst,
    CUdeviceptr src,
    const std::vector<int64_t>& sizes,
    const std::vector<int64_t>& strides,
    size_t elemSize) {
  if (elemSize != 1 && elemSize != 2 && elemSize != 4 && elemSize != 8 &&
      elemSize != 16) {
    throw std::invalid_argument(
        "strided copy of " + std::to_string(elemSize) +
        "-byte elements (1, 2, 4, 8 or 16)");
  }
  // The kernels access whole elements, aligned to min(elemSize, 8): an
  // address that is not (a view made with from_blob, say) goes as bytes,
  // since a misaligned access would leave the context unusable.
  const uint64_t align = std::min<size_t>(elemSize, 8);
  std::vector<int64_t> sizesIn = sizes;
  std::vector<int64_t> stridesIn = strides;
  if ((dst | src) % align != 0) {
    for (int64_t& st : stridesIn) {
      st *= static_cast<int64_t>(elemSize);
    }
    sizesIn.push_back(static_cast<int64_t>(elemSize));
    stridesIn.push_back(1);
    elemSize = 1;
  }
  auto dims = mergeDims(sizesIn, stridesIn);
  uint64_t numel = 1;
  for (const auto& [size, stride] : dims) {
    numel *= static_cast<uint64_t>(size);
  }
  if (numel == 0) {
    return;
  }
  if (dims.empty() || (dims.size() == 1 && dims[0].second == 1)) {
    copy(stream, dst, src, numel * elemSize);
    return;
  }
  if (dims.size() == 2 && dims[1].second == 1 &&
      static_cast<uint64_t>(dims[1].first) * elemSize >= kRowCopyMinBytes &&
      dims[0].second >= dims[1].first &&
      static_cast<uint64_t>(dims[0].second) * elemSize <= kMaxRowPitch) {
    // (Rows that do not overlap: an expanded view, stride 0, goes by the
    // kernel, since a pitch narrower than a row is no pitched copy; as does
    // a pitch past what the driver takes.)
    // Rows contiguous inside (a slice of rows, every other row): one
    // pitched copy moves them whole, rather than the strided kernel one
    // element at a time with a division per dimension each.
    const uint64_t row = static_cast<uint64_t>(dims[1].first) * elemSize;
    const uint64_t pitch = static_cast<uint64_t>(dims[0].second) * elemSize;
    CUDA_MEMCPY2D c{};
    c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c.srcDevice = src;
    c.dstDevice = dst;
    c.srcPitch = k == kPack ? pitch : row;
    c.dstPitch = k == kPack ? row : pitch;
    c.WidthInBytes = row;
    c.Height = static_cast<size_t>(dims[0].first);
    CurrentDevice current(device_);
    TORCH_RPC_EXT_CUDA_CHECK(cuMemcpy2DAsync, &c, stream);
    rowCopies_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  std::vector<uint64_t> desc = {dims.size(), elemSize, numel};
  for (const auto& d : dims) {
    desc.push_back(static_cast<uint64_t>(d.first));
  }
  for (const auto& d : dims) {
    desc.push_back(static_cast<uint64_t>(d.second));
  }
  CurrentDevice current(device_);
  withTable(stream, desc, [&](CUdeviceptr device) {
    launch(k, stream, ceilDiv(numel, kThreads), dst, src, device);
  });
}

void CopyEngine::pack(
    CUstream stream,
    CUdeviceptr contiguousDst,
    CUdeviceptr stridedSrc,
    const std::vector<int64_t>& sizes,
    const std::vector<int64_t>& strides,
    size_t elemSize) {
  strided(kPack, stream, contiguousDst, stridedSrc, sizes, strides, elemSize);
}

void CopyEngine::unpack(
    CUstream stream,
    CUdeviceptr stridedDst,
    CUdeviceptr contiguousSrc,
    const std::vector<int64_t>& sizes,
    const std::vector<int64_t>& strides,
    size_t elemSize) {
  strided(kUnpack, stream, stridedDst, contiguousSrc, sizes, strides, elemSize);
}

size_t CopyEngine::stagingBuffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return staging_.size();
}

std::map<std::string, uint64_t> CopyEngine::launches() const {
  std::map<std::string, uint64_t> out;
  for (int k = 0; k < kNumKernels; ++k) {
    out[kNames[k]] = launches_[k].load(std::memory_order_relaxed);
  }
  out["row_copies"] = rowCopies_.load(std::memory_order_relaxed);
  out["driver_copies"] = driverCopies_.load(std::memory_order_relaxed);
  return out;
}

} // namespace torch_rpc_ext::channel::cuda
