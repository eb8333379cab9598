// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/host_load.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace torch_rpc_ext {

double cpuPressurePercent() {
  // Tests only: a saturated host without saturating the test machine.
  if (const char* test = std::getenv("TORCH_RPC_EXT_TEST_CPU_PRESSURE")) {
    return std::atof(test);
  }
  // "some avg10=12.48 avg60=47.19 avg300=47.09 total=2341806780"
  std::FILE* f = std::fopen("/proc/pressure/cpu", "re");
  if (f == nullptr) {
    return -1;
  }
  char line[256] = {};
  double avg10 = -1;
  if (std::fgets(line, sizeof(line), f) != nullptr &&
      std::strncmp(line, "some ", 5) == 0) {
    if (std::sscanf(line + 5, "avg10=%lf", &avg10) != 1) {
      avg10 = -1;
    }
  }
  std::fclose(f);
  return avg10;
}

} // namespace torch_rpc_ext
