// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <string>

namespace torch_rpc_ext {

// This boot of this host's kernel (/proc/sys/kernel/random/boot_id): equal in
// two processes exactly when they run on the same booted kernel, so memory
// one of them passes as a descriptor is memory both can map. Empty if
// unknown. Read once.
const std::string& bootId();

// This process's PID namespace (the target of /proc/self/ns/pid, such as
// "pid:[4026531836]"): legacy CUDA IPC handles open only between processes
// of one namespace. Empty if unknown. Read once.
const std::string& pidNamespace();

} // namespace torch_rpc_ext
