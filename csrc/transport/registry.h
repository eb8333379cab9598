// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport {

// Names of the transports this build has, in default preference order.
std::vector<std::string> transportNames();

// A new transport by name; throws std::invalid_argument for an unknown name.
std::shared_ptr<Transport> createTransport(
    const std::string& name,
    const TransportOptions& options);

// The address a worker advertises when its options name none (the stream
// core's rule: TORCH_RPC_EXT_ADDR, TORCH_RPC_EXT_SOCKET_IFNAME, the
// hostname, else 127.0.0.1).
std::string defaultAdvertisedAddress();

} // namespace torch_rpc_ext::transport
