// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/libcuda.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "csrc/common/dl_error.h"

namespace torch_rpc_ext {

namespace {

constexpr const char* kOverrideEnv = "TORCH_RPC_EXT_LIBCUDA";
constexpr const char* kDefaultName = "libcuda.so.1";
// The oldest driver with every entry point of the table as declared
// (cuMemCreate's POSIX fd handles, cuLaunchHostFunc, cuDeviceGetUuid_v2):
// CUDA 11.4.
constexpr int kMinDriverVersion = 11040;

#define TORCH_RPC_EXT_STR2(x) #x
// Expands cuda.h's macro first: the ABI name (cuEventDestroy_v2).
#define TORCH_RPC_EXT_STR(x) TORCH_RPC_EXT_STR2(x)

std::atomic<bool> attempted{false};

std::string versionText(int version) {
  return std::to_string(version / 1000) + "." +
      std::to_string(version % 1000 / 10);
}

// Fills `out` from `handle`; "" on success, else what is wrong with it.
std::string bind(void* handle, Libcuda& out) {
  std::string missing;
#define TORCH_RPC_EXT_CUDA_BIND(fn)                                       \
  out.fn = reinterpret_cast<decltype(out.fn)>(                            \
      dlsym(handle, TORCH_RPC_EXT_STR(fn)));                              \
  if (out.fn == nullptr) {                                                \
    missing +=                                                            \
        std::string(missing.empty() ? "" : ", ") + TORCH_RPC_EXT_STR(fn); \
  }
  TORCH_RPC_EXT_FOR_EACH_CUDA_FN(TORCH_RPC_EXT_CUDA_BIND)
#undef TORCH_RPC_EXT_CUDA_BIND
  if (out.cuDriverGetVersion != nullptr &&
      out.cuDriverGetVersion(&out.driverVersion) == CUDA_SUCCESS &&
      out.driverVersion < kMinDriverVersion) {
    return "its CUDA version is " + versionText(out.driverVersion) +
        "; torch_rpc_ext needs " + versionText(kMinDriverVersion) +
        " or newer (update the NVIDIA driver)";
  }
  if (!missing.empty()) {
    return "it lacks " + missing +
        " (not a CUDA driver library, or one "
        "older than CUDA " +
        versionText(kMinDriverVersion) + ")";
  }
  if (out.driverVersion == 0) {
    return "cuDriverGetVersion failed";
  }
  return "";
}

struct LoadedDriver {
  LoadedDriver() {
    attempted = true;
    const char* override = std::getenv(kOverrideEnv);
    const bool overridden = override != nullptr && *override != '\0';
    const std::string name = overridden ? override : kDefaultName;
    const std::string where = overridden
        ? std::string(" (named by ") + kOverrideEnv + ")"
        : std::string();
    dlerror();
    // RTLD_LOCAL: the fake of the tests must not stand in for anyone else.
    void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      error =
          "torch_rpc_ext needs the NVIDIA driver's CUDA library to move "
          "CUDA tensors, and could not load it: dlopen(\"" +
          name + "\")" + where + ": " + dlerrorText() +
          "\nFix: run on a machine with an NVIDIA GPU and its driver, put the "
          "directory holding libcuda.so.1 on LD_LIBRARY_PATH, or set " +
          kOverrideEnv + " to its path. CPU tensors need no CUDA library.";
      return;
    }
    std::string why = bind(handle, lib);
    const bool initCalled = why.empty();
    if (initCalled) {
      CUresult rc = lib.cuInit(0);
      if (rc == CUDA_ERROR_NO_DEVICE) {
        why = cudaErrorTextWith(lib, "cuInit", rc) +
            " (no GPU visible to this process: check CUDA_VISIBLE_DEVICES)";
      } else if (rc != CUDA_SUCCESS) {
        why = cudaErrorTextWith(lib, "cuInit", rc) +
            " (no usable GPU, or a driver that does not match the kernel "
            "module)";
      }
    }
    if (!why.empty()) {
      error = "torch_rpc_ext cannot use the CUDA library " + name + where +
          ": " + why;
      if (!initCalled) {
        dlclose(handle);
      } // else kept: cuInit may have started threads or exit handlers.
      lib = Libcuda{};
      return;
    }
    lib.description = "CUDA driver " + versionText(lib.driverVersion);
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(lib.cuInit), &info) != 0 &&
        info.dli_fname != nullptr) {
      lib.description += std::string(" (") + info.dli_fname + ")";
    }
  }

  static std::string cudaErrorTextWith(
      const Libcuda& lib,
      const char* what,
      CUresult rc) {
    const char* name = nullptr;
    const char* text = nullptr;
    if (lib.cuGetErrorName == nullptr ||
        lib.cuGetErrorName(rc, &name) != CUDA_SUCCESS) {
      name = nullptr;
    }
    if (lib.cuGetErrorString == nullptr ||
        lib.cuGetErrorString(rc, &text) != CUDA_SUCCESS) {
      text = nullptr;
    }
    std::string out = std::string(what) + ": " +
        (name != nullptr ? name : "CUDA error " + std::to_string(rc));
    if (text != nullptr) {
      out += std::string(" (") + text + ")";
    }
    return out;
  }

  std::string error;
  Libcuda lib;
};

const LoadedDriver& loaded() {
  static const LoadedDriver instance; // Once, thread-safe (C++11 magic static).
  return instance;
}

} // namespace

const Libcuda& libcuda() {
  const LoadedDriver& l = loaded();
  if (l.lib.cuInit == nullptr) {
    throw std::runtime_error(l.error);
  }
  return l.lib;
}

bool libcudaLoadAttempted() {
  return attempted;
}

std::string cudaErrorText(const char* what, CUresult rc) {
  // Only reached after a call through the table, so the library is loaded.
  return LoadedDriver::cudaErrorTextWith(libcuda(), what, rc);
}

void checkCuda(const char* what, CUresult rc) {
  if (rc != CUDA_SUCCESS) {
    throw CudaError(cudaErrorText(what, rc), rc);
  }
}

} // namespace torch_rpc_ext
