// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/factory.h"

#include "csrc/transport/tcp/transport.h"

namespace torch_rpc_ext::transport::tcp {

std::shared_ptr<Transport> create(const TransportOptions& options) {
  return std::make_shared<TcpTransport>(options);
}

} // namespace torch_rpc_ext::transport::tcp
