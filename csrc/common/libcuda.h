// SPDX-License-Identifier: BSD-3-Clause
// The CUDA driver (libcuda), found at run time. The extension does not link
// it: one build serves CPU and CUDA torch, and a process that never moves a
// CUDA tensor loads no CUDA library. The first call of libcuda() dlopen()s
// libcuda.so.1, resolves the table below and calls cuInit(0); CUDA work in
// this extension goes through that table only.
//
// cuda.h is needed at build time only (for the types and for the ABI name of
// each entry point: cuda.h maps cuEventDestroy to cuEventDestroy_v2 and so on,
// and the table is resolved by those names). setup.py takes it from NVIDIA's
// nvidia-cuda-runtime wheel or $CUDA_HOME.
//
// Tests load a fake driver instead (tests/cuda_fake): it exports the same
// names with memfds for device memory. TORCH_RPC_EXT_LIBCUDA=<path or name>
// loads that file instead of libcuda.so.1, as Triton's TRITON_LIBCUDA_PATH.
#pragma once

#include <cuda.h>

#include <stdexcept>
#include <string>

namespace torch_rpc_ext {

// Every driver entry point the extension calls, by its cuda.h name.
#define TORCH_RPC_EXT_FOR_EACH_CUDA_FN(X) \
  X(cuInit)                               \
  X(cuDriverGetVersion)                   \
  X(cuGetErrorName)                       \
  X(cuGetErrorString)                     \
  X(cuDeviceGetCount)                     \
  X(cuDeviceGet)                          \
  X(cuDeviceGetUuid)                      \
  X(cuDeviceGetAttribute)                 \
  X(cuDeviceCanAccessPeer)                \
  X(cuDevicePrimaryCtxRetain)             \
  X(cuDevicePrimaryCtxRelease)            \
  X(cuCtxGetCurrent)                      \
  X(cuCtxSetCurrent)                      \
  X(cuMemAlloc)                           \
  X(cuMemFree)                            \
  X(cuMemGetAddressRange)                 \
  X(cuMemcpyHtoD)                         \
  X(cuMemcpyDtoH)                         \
  X(cuMemcpyAsync)                        \
  X(cuMemcpy2DAsync)                      \
  X(cuMemcpyHtoDAsync)                    \
  X(cuMemcpyDtoHAsync)                    \
  X(cuMemHostAlloc)                       \
  X(cuMemFreeHost)                        \
  X(cuMemHostRegister)                    \
  X(cuMemHostUnregister)                  \
  X(cuMemGetAllocationGranularity)        \
  X(cuMemCreate)                          \
  X(cuMemRelease)                         \
  X(cuMemExportToShareableHandle)         \
  X(cuMemImportFromShareableHandle)       \
  X(cuMemAddressReserve)                  \
  X(cuMemAddressFree)                     \
  X(cuMemMap)                             \
  X(cuMemUnmap)                           \
  X(cuMemSetAccess)                       \
  X(cuIpcGetMemHandle)                    \
  X(cuIpcOpenMemHandle)                   \
  X(cuIpcCloseMemHandle)                  \
  X(cuStreamCreate)                       \
  X(cuStreamDestroy)                      \
  X(cuStreamSynchronize)                  \
  X(cuStreamWaitEvent)                    \
  X(cuThreadExchangeStreamCaptureMode)    \
  X(cuLaunchHostFunc)                     \
  X(cuEventCreate)                        \
  X(cuEventDestroy)                       \
  X(cuEventRecord)                        \
  X(cuEventQuery)                         \
  X(cuEventSynchronize)                   \
  X(cuIpcGetEventHandle)                  \
  X(cuIpcOpenEventHandle)                 \
  X(cuModuleLoadData)                     \
  X(cuModuleUnload)                       \
  X(cuModuleGetFunction)                  \
  X(cuLaunchKernel)

struct Libcuda {
  // Members carry cuda.h's names after its macros (cuEventDestroy_v2, ...);
  // call them with the plain names, which the same macros rewrite.
#define TORCH_RPC_EXT_CUDA_MEMBER(fn) decltype(&::fn) fn = nullptr;
  TORCH_RPC_EXT_FOR_EACH_CUDA_FN(TORCH_RPC_EXT_CUDA_MEMBER)
#undef TORCH_RPC_EXT_CUDA_MEMBER

  int driverVersion = 0; // cuDriverGetVersion(): 13000 for CUDA 13.0
  // "CUDA driver 13.0 (<file it was loaded from>)".
  std::string description;
};

// The driver, loaded and initialised on the first call only (thread-safe;
// never unloaded). Throws std::runtime_error, on this and every later call,
// naming libcuda, where it looked and how to fix it, if the library is
// absent, lacks an entry point, or cuInit fails (no GPU, driver/kernel
// module mismatch).
const Libcuda& libcuda();

// Whether libcuda() has been called in this process (and succeeded or
// failed): false in a program that never touched a CUDA tensor.
bool libcudaLoadAttempted();

// "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
std::string cudaErrorText(const char* what, CUresult rc);

// What checkCuda() throws: the text of cudaErrorText(), and the code.
class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& text, CUresult code)
      : std::runtime_error(text), code_(code) {}
  CUresult code() const {
    return code_;
  }

 private:
  CUresult code_;
};

// Throws CudaError with cudaErrorText(what, rc) unless rc is CUDA_SUCCESS.
void checkCuda(const char* what, CUresult rc);

} // namespace torch_rpc_ext

// Calls libcuda().fn(args...) and throws naming the call on failure:
// TORCH_RPC_EXT_CUDA_CHECK(cuMemCreate, &handle, size, &prop, 0);
#define TORCH_RPC_EXT_CUDA_CHECK(fn, ...) \
  ::torch_rpc_ext::checkCuda(#fn, ::torch_rpc_ext::libcuda().fn(__VA_ARGS__))
