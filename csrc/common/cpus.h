// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sched.h>

namespace torch_rpc_ext {

// The CPUs the calling thread may run on now (its affinity mask, as taskset,
// cgroup cpusets and container runtimes set it; a process's threads start
// with their creator's). Where the mask cannot be read (more CPUs than a
// cpu_set_t holds), kManyCpus: a policy for few CPUs then stays off.
inline constexpr int kManyCpus = 1 << 20;
inline int allowedCpus() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) != 0 || CPU_COUNT(&set) == 0) {
    return kManyCpus;
  }
  return CPU_COUNT(&set);
}

} // namespace torch_rpc_ext
