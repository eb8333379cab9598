// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/host.h"

#include <unistd.h>

#include <fstream>

namespace torch_rpc_ext {

const std::string& bootId() {
  static const std::string id = [] {
    std::string boot;
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::getline(in, boot);
    return boot;
  }();
  return id;
}

const std::string& pidNamespace() {
  static const std::string ns = [] {
    char target[128];
    ssize_t n = ::readlink("/proc/self/ns/pid", target, sizeof(target) - 1);
    return n > 0 ? std::string(target, size_t(n)) : std::string();
  }();
  return ns;
}

} // namespace torch_rpc_ext
