// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/cuda/exported_memory.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "csrc/channel/cuda/device.h"
#include "csrc/common/libcuda.h"

namespace torch_rpc_ext::channel::cuda {

namespace {

CUmemAllocationProp properties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// Legacy blocks are sized as cudaMalloc's large pool rounds (2 MiB): an
// allocation holds one block, so a small one is not worth making.
constexpr size_t kLegacyGranularity = size_t(2) << 20;

} // namespace

size_t ExportedMemory::granularity(int device, Sharing sharing) {
  if (sharing == Sharing::kLegacy) {
    return kLegacyGranularity;
  }
  // No context needed, and none made current: a guard here retained a
  // primary context on every device each connection could share (one per
  // GPU of the node, for every rank), not just the ones it uses.
  CUmemAllocationProp prop = properties(device);
  size_t out = 0;
  TORCH_RPC_EXT_CUDA_CHECK(
      cuMemGetAllocationGranularity,
      &out,
      &prop,
      CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  return out;
}

std::unique_ptr<ExportedMemory> ExportedMemory::create(
    int device,
    size_t bytes,
    Sharing sharing) {
  const size_t unit = granularity(device, sharing);
  const size_t size = (std::max<size_t>(bytes, 1) + unit - 1) / unit * unit;
  CurrentDevice current(device);
  if (sharing == Sharing::kLegacy) {
    std::unique_ptr<ExportedMemory> out(
        new ExportedMemory(device, size, sharing, 0, /*owner=*/true));
    TORCH_RPC_EXT_CUDA_CHECK(cuMemAlloc, &out->address_, size);
    return out;
  }
  CUmemAllocationProp prop = properties(device);
  CUmemGenericAllocationHandle handle;
  TORCH_RPC_EXT_CUDA_CHECK(cuMemCreate, &handle, size, &prop, 0);
  std::unique_ptr<ExportedMemory> out(
      new ExportedMemory(device, size, sharing, handle, /*owner=*/true));
  out->map(unit);
  return out;
}

std::unique_ptr<ExportedMemory> ExportedMemory::import(
    int fd,
    size_t bytes,
    int device) {
  const size_t unit = granularity(device);
  if (bytes == 0 || bytes % unit != 0) {
    throw std::invalid_argument(
        "imported CUDA memory of " + std::to_string(bytes) +
        " bytes: not a multiple of the allocation granularity");
  }
  CurrentDevice current(device);
  CUmemGenericAllocationHandle handle;
  TORCH_RPC_EXT_CUDA_CHECK(
      cuMemImportFromShareableHandle,
      &handle,
      reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  std::unique_ptr<ExportedMemory> out(
      new ExportedMemory(device, bytes, Sharing::kFd, handle, /*owner=*/false));
  out->map(unit);
  return out;
}

std::unique_ptr<ExportedMemory> ExportedMemory::importLegacy(
    const CUipcMemHandle& handle,
    size_t bytes,
    int device) {
  if (bytes == 0 || bytes % kLegacyGranularity != 0) {
    throw std::invalid_argument(
        "imported CUDA memory of " + std::to_string(bytes) +
        " bytes: not a multiple of 2 MiB");
  }
  CurrentDevice current(device);
  std::unique_ptr<ExportedMemory> out(
      new ExportedMemory(device, bytes, Sharing::kLegacy, 0, /*owner=*/false));
  TORCH_RPC_EXT_CUDA_CHECK(
      cuIpcOpenMemHandle,
      &out->address_,
      handle,
      CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  // `bytes` is the peer's word, and a legacy handle opens whatever the
  // allocation is: every copy out of the block is checked against `bytes`,
  // so an allocation smaller than that would let a record name memory past
  // the mapping (an illegal address: the context's end). A descriptor's
  // cuMemMap refuses such a size itself.
  CUdeviceptr base = 0;
  size_t mapped = 0;
  const CUresult r =
      libcuda().cuMemGetAddressRange(&base, &mapped, out->address_);
  if (r != CUDA_SUCCESS || base != out->address_ || mapped < bytes) {
    libcuda().cuIpcCloseMemHandle(out->address_);
    out->address_ = 0;
    throw std::invalid_argument(
        r != CUDA_SUCCESS
            ? "imported CUDA memory of unknown size (cuMemGetAddressRange: " +
                std::to_string(static_cast<int>(r)) + ")"
            : "imported CUDA memory of " + std::to_string(mapped) +
                " bytes, announced as " + std::to_string(bytes));
  }
  return out;
}

ExportedMemory::ExportedMemory(
    int device,
    size_t size,
    Sharing sharing,
    CUmemGenericAllocationHandle h,
    bool owner)
    : device_(device),
      size_(size),
      sharing_(sharing),
      handle_(h),
      owner_(owner) {}

void ExportedMemory::map(size_t alignment) {
  // On failure the destructor (run by the unique_ptr the caller holds)
  // undoes what was done.
  TORCH_RPC_EXT_CUDA_CHECK(
      cuMemAddressReserve, &address_, size_, alignment, 0, 0);
  TORCH_RPC_EXT_CUDA_CHECK(cuMemMap, address_, size_, 0, handle_, 0);
  mapped_ = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  TORCH_RPC_EXT_CUDA_CHECK(cuMemSetAccess, address_, size_, &access, 1);
}

void ExportedMemory::grantAccess(int device) {
  if (device == device_ || grantedTo(device)) {
    return;
  }
  if (sharing_ != Sharing::kFd || !mapped_) {
    throw std::logic_error("only a mapped descriptor's memory opens to peers");
  }
  CurrentDevice current(device_);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  TORCH_RPC_EXT_CUDA_CHECK(cuMemSetAccess, address_, size_, &access, 1);
  peers_.push_back(device);
}

bool ExportedMemory::grantedTo(int device) const {
  return device == device_ ||
      std::find(peers_.begin(), peers_.end(), device) != peers_.end();
}

ExportedMemory::~ExportedMemory() {
  try {
    CurrentDevice current(device_);
    const Libcuda& cu = libcuda();
    if (sharing_ == Sharing::kLegacy) {
      if (address_ != 0) {
        owner_ ? cu.cuMemFree(address_) : cu.cuIpcCloseMemHandle(address_);
      }
      return;
    }
    if (mapped_) {
      cu.cuMemUnmap(address_, size_);
    }
    if (address_ != 0) {
      cu.cuMemAddressFree(address_, size_);
    }
    cu.cuMemRelease(handle_);
  } catch (const std::exception&) {
    // The driver is gone (process exit): nothing left to release.
  }
}

int ExportedMemory::exportFd() const {
  if (!owner_) {
    throw std::logic_error("imported CUDA memory is exported by its creator");
  }
  if (sharing_ != Sharing::kFd) {
    throw std::logic_error(
        "CUDA memory with a legacy handle has no descriptor");
  }
  CurrentDevice current(device_);
  int fd = -1;
  TORCH_RPC_EXT_CUDA_CHECK(
      cuMemExportToShareableHandle,
      &fd,
      handle_,
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      0);
  return fd;
}

CUipcMemHandle ExportedMemory::legacyHandle() const {
  if (!owner_ || sharing_ != Sharing::kLegacy) {
    throw std::logic_error(
        "CUDA memory has a legacy handle only where it was made, as kLegacy");
  }
  CurrentDevice current(device_);
  CUipcMemHandle handle;
  TORCH_RPC_EXT_CUDA_CHECK(cuIpcGetMemHandle, &handle, address_);
  return handle;
}

} // namespace torch_rpc_ext::channel::cuda
