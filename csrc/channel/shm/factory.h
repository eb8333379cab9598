// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>

#include "csrc/channel/channel.h"

namespace torch_rpc_ext::channel::shm {

// The shm channels' contexts (context.h), for the registry.
std::shared_ptr<Context> createSlabChannel(WireIds ids);
std::shared_ptr<Context> createRingChannel(WireIds ids);

} // namespace torch_rpc_ext::channel::shm
