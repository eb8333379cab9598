// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/shm/factory.h"

#include "csrc/transport/shm/transport.h"

namespace torch_rpc_ext::transport::shm {

std::shared_ptr<Transport> create(const TransportOptions& options) {
  return std::make_shared<ShmTransport>(options);
}

} // namespace torch_rpc_ext::transport::shm
