// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>

#include "csrc/channel/channel.h"

namespace torch_rpc_ext::channel::lanes {

// tcp_lanes (context.h), for the registry.
std::shared_ptr<Context> createLanesChannel(WireIds ids);

} // namespace torch_rpc_ext::channel::lanes
