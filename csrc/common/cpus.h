// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sched.h>

namespace torch_rpc_ext {

// The CPUs this process may run on now (its affinity mask, as taskset,
// cgroup cpusets and container runtimes set it), at least 1.
inline int allowedCpus() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) {
    return 1;
  }
  return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
}

} // namespace torch_rpc_ext
