// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/listener.h"

#include "csrc/transport/tcp/transport.h"

namespace torch_rpc_ext::transport::tcp {

namespace {

std::string bindHost(const TcpTransport& transport) {
  const auto& host = transport.options().bindAddress;
  return host.empty() ? stream::defaultAdvertisedAddress() : host;
}

} // namespace

TcpListener::TcpListener(TcpTransport& transport)
    : StreamListener(
          transport,
          stream::SocketAddress::fromHost(bindHost(transport), 0),
          bindHost(transport),
          " (set the `address` option or TORCH_RPC_EXT_ADDR / "
          "TORCH_RPC_EXT_SOCKET_IFNAME to an address of this host)") {}

} // namespace torch_rpc_ext::transport::tcp
