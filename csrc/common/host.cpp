// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/host.h"

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

} // namespace torch_rpc_ext
