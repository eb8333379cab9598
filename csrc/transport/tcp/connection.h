// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::tcp {

// A TCP connection: the stream core with Nagle off and keepalive on. Every
// byte of a frame travels in the stream; it speaks no control frames and no
// record segments beyond the core's.
class TcpConnection final : public stream::StreamConnection {
 public:
  TcpConnection(
      stream::Loop& loop,
      const TransportOptions& options,
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer);

 protected:
  void tuneSocket() override;
};

} // namespace torch_rpc_ext::transport::tcp
