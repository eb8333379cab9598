// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/shm/connection.h"

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

} // namespace torch_rpc_ext::transport::shm
