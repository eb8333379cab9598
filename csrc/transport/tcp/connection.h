// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::tcp {

// A TCP connection: the stream core with Nagle off and keepalive on. It
// passes no descriptors, so it hosts none of the shm channels: every byte
// of a frame travels in the stream.
class TcpConnection final : public stream::StreamConnection {
 public:
  TcpConnection(
      stream::Loop& loop,
      const TransportOptions& options,
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer,
      std::shared_ptr<const TlsContext> tls);

 protected:
  void tuneSocket() override;
};

} // namespace torch_rpc_ext::transport::tcp
