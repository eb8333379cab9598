// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/factory.h"

#include "csrc/transport/tcp/transport.h"

namespace torch_rpc_ext::transport::tcp {

std::shared_ptr<Transport> create(const TransportOptions& options) {
  // Before the transport starts its loop thread: a certificate that cannot
  // be used is an error with nothing to stop.
  auto tls = TlsContext::create(options.tls, options.secret);
  return std::make_shared<TcpTransport>(options, std::move(tls));
}

} // namespace torch_rpc_ext::transport::tcp
