// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "csrc/channel/channel.h"

namespace torch_rpc_ext::channel {

// What the stream itself is called where channels are listed: it carries
// every segment no channel takes, on every transport, and is not negotiated.
inline constexpr const char* kStreamChannelName = "basic";

// Names of the out-of-band channels this build has (of one device kind, or
// all), in default preference order.
std::vector<std::string> channelNames(
    std::optional<DeviceKind> device = std::nullopt);

// A new channel context by name, with the wire ids of its position in the
// list; throws std::invalid_argument for an unknown name.
std::shared_ptr<Context> createChannel(const std::string& name);

// The CUDA channels' copy kernels, {name: (mangled entry, PTX)}, as
// torch_rpc_ext._cuda.ptx compiles them: needed before a CUDA tensor moves.
void setCudaKernels(
    const std::map<std::string, std::pair<std::string, std::string>>& kernels);

} // namespace torch_rpc_ext::channel
