// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/registry.h"

#include <stdexcept>

#include "csrc/transport/tcp/factory.h"

namespace torch_rpc_ext::transport {

std::vector<std::string> transportNames() {
  return {"shm", "tcp"};
}

std::shared_ptr<Transport> createTransport(
    const std::string& name,
    const TransportOptions& options) {
  if (name == "tcp") {
    return tcp::create(options);
  }
  if (name == "shm") {
    return tcp::createShm(options);
  }
  throw std::invalid_argument("unknown transport '" + name + "'");
}

} // namespace torch_rpc_ext::transport
