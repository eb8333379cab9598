// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/connection.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

namespace torch_rpc_ext::transport::tcp {

TcpConnection::TcpConnection(
    stream::Loop& loop,
    const TransportOptions& options,
    int fd,
    bool outbound,
    int32_t expectedPeerId,
    std::string peerAddress,
    ConnectionObserver* observer,
    std::shared_ptr<const TlsContext> tls)
    : StreamConnection(
          loop,
          options,
          "tcp",
          fd,
          outbound,
          expectedPeerId,
          std::move(peerAddress),
          observer,
          std::move(tls)) {}

void TcpConnection::tuneSocket() {
  int one = 1;
  ::setsockopt(fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd(), SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
}

} // namespace torch_rpc_ext::transport::tcp
