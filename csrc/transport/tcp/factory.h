// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>

#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::tcp {

// TCP sockets: reaches any host; the transport of last resort.
std::shared_ptr<Transport> create(const TransportOptions& options);

} // namespace torch_rpc_ext::transport::tcp
