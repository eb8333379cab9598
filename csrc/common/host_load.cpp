// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/host_load.h"

#include <atomic>
#include <cstdio>
#include <cstring>

namespace torch_rpc_ext {

namespace {

std::atomic<bool> testSet{false};
std::atomic<double> testPercent{0};

} // namespace

void setCpuPressureForTests(std::optional<double> percent) {
  testPercent.store(percent.value_or(0));
  testSet.store(percent.has_value());
}

double cpuPressurePercent() {
  if (testSet.load()) {
    return testPercent.load();
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
