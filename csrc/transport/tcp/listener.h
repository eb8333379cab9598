// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include "csrc/transport/stream/listener.h"

namespace torch_rpc_ext::transport::tcp {

class TcpTransport;

// A TCP socket listening on the transport's bind address, on a port the
// kernel picks.
class TcpListener final : public stream::StreamListener {
 public:
  explicit TcpListener(TcpTransport& transport);
};

} // namespace torch_rpc_ext::transport::tcp
