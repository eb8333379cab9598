// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>

#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::tcp {

// "tcp": TCP sockets, across hosts.
std::shared_ptr<Transport> create(const TransportOptions& options);
// "shm": an abstract Unix socket plus shared-memory rings, one host only.
std::shared_ptr<Transport> createShm(const TransportOptions& options);

} // namespace torch_rpc_ext::transport::tcp
