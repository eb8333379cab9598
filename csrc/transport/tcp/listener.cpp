// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/listener.h"

#include "csrc/transport/tcp/transport.h"

namespace torch_rpc_ext::transport::tcp {

TcpListener::TcpListener(TcpTransport& transport)
    : StreamListener(
          transport,
          stream::SocketAddress::fromHost(transport.bindHost(), 0),
          transport.bindHost(),
          " (set the `address` option or TORCH_RPC_EXT_ADDR / "
          "TORCH_RPC_EXT_SOCKET_IFNAME to an address of this host)") {}

} // namespace torch_rpc_ext::transport::tcp
