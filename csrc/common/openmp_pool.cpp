// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/openmp_pool.h"

#include <dlfcn.h>

#include <cstring>

namespace torch_rpc_ext {

namespace {

using PauseResource = int (*)(int kind, int device);
using InitialDevice = int (*)();

// OpenMP 5.0's omp_pause_soft.
constexpr int kPauseSoft = 1;

struct GnuOpenMp {
  PauseResource pause = nullptr;
  InitialDevice initialDevice = nullptr;

  GnuOpenMp() {
    // Looked up in what the process has loaded (torch loads its libgomp
    // before any of our threads serves a request); never loaded by us.
    void* pauseSymbol = ::dlsym(RTLD_DEFAULT, "omp_pause_resource");
    void* deviceSymbol = ::dlsym(RTLD_DEFAULT, "omp_get_initial_device");
    Dl_info info{};
    if (pauseSymbol == nullptr || deviceSymbol == nullptr ||
        ::dladdr(pauseSymbol, &info) == 0 || info.dli_fname == nullptr ||
        std::strstr(info.dli_fname, "libgomp") == nullptr) {
      return;
    }
    pause = reinterpret_cast<PauseResource>(pauseSymbol);
    initialDevice = reinterpret_cast<InitialDevice>(deviceSymbol);
  }
};

} // namespace

bool releaseOpenMpTeam() {
  static const GnuOpenMp omp;
  if (omp.pause == nullptr) {
    return false;
  }
  // libgomp: frees the calling thread's pool, if it has one and is not in
  // a parallel region (then -1, and nothing changes).
  return omp.pause(kPauseSoft, omp.initialDevice()) == 0;
}

} // namespace torch_rpc_ext
