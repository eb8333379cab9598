// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>

#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::shm {

// Abstract Unix sockets plus shared memory: processes of one host only.
std::shared_ptr<Transport> create(const TransportOptions& options);

} // namespace torch_rpc_ext::transport::shm
