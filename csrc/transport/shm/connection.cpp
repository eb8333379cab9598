// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/shm/connection.h"

#include <sys/socket.h>

namespace torch_rpc_ext::transport::shm {

ShmConnection::ShmConnection(
    stream::Loop& loop,
    const TransportOptions& options,
    int fd,
    bool outbound,
    int32_t expectedPeerId,
    std::string peerAddress,
    ConnectionObserver* observer)
    : StreamConnection(
          loop,
          options,
          "shm",
          fd,
          outbound,
          expectedPeerId,
          std::move(peerAddress),
          observer) {}

void ShmConnection::tuneSocket() {
  // A Unix stream socket's send buffer bounds the bytes in flight to the
  // peer (its default, 208 KiB, makes a 1 MiB segment that travels in the
  // stream five sends and five wake-ups of each side, which on a host full
  // of workers each wait for a CPU). TCP on loopback grows its buffers to 4
  // MiB by itself; ask for as much (the kernel caps it at wmem_max).
  int bytes = kSendBufferBytes;
  ::setsockopt(fd(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
}

} // namespace torch_rpc_ext::transport::shm
