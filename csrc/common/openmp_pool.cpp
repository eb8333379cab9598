// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/openmp_pool.h"

#include <dlfcn.h>

#include <cstring>

namespace torch_rpc_ext {

namespace {

using PauseResourceAll = int (*)(int kind);

// OpenMP 5.0's omp_pause_soft.
constexpr int kPauseSoft = 1;

// omp_pause_resource_all, if the process's OpenMP is GNU libgomp: looked up
// in what the process has loaded (torch loads its libgomp before any of our
// threads serves a request), never loaded by us. libgomp's is
// gomp_pause_host() in every version, with no device set-up (its
// omp_pause_resource and omp_get_initial_device start the offload plugins
// in GCC 11 and later). The object holding it must be libgomp by name and
// not export LLVM's entry point (conda's llvm-openmp installs libomp under
// libgomp's name), whose pause is process-wide.
PauseResourceAll findGnuPause() {
  void* symbol = ::dlsym(RTLD_DEFAULT, "omp_pause_resource_all");
  Dl_info info{};
  if (symbol == nullptr || ::dladdr(symbol, &info) == 0 ||
      info.dli_fname == nullptr) {
    return nullptr;
  }
  const char* slash = std::strrchr(info.dli_fname, '/');
  const char* base = slash != nullptr ? slash + 1 : info.dli_fname;
  if (std::strncmp(base, "libgomp", 7) != 0) {
    return nullptr;
  }
  void* handle = ::dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) {
    return nullptr;
  }
  bool llvm = ::dlsym(handle, "__kmpc_fork_call") != nullptr;
  ::dlclose(handle);
  return llvm ? nullptr : reinterpret_cast<PauseResourceAll>(symbol);
}

} // namespace

bool releaseOpenMpTeam() {
  static const PauseResourceAll pause = findGnuPause();
  // libgomp: frees the calling thread's pool, if it has one and is not in a
  // parallel region (then -1, and nothing changes).
  return pause != nullptr && pause(kPauseSoft) == 0;
}

} // namespace torch_rpc_ext
