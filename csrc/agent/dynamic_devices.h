// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// Device maps in a dynamic group (docs/elastic.md, "Device maps"): each
// member publishes, in its join record, the CUDA devices it receives on and
// its maps; a joiner checks its maps against the members it finds, and theirs
// against itself, before it joins; a member answers a peer through the
// reverse of the peer's map to it.

#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/rpc/rpc_agent.h>

namespace torch_rpc_ext {

namespace rpc = torch::distributed::rpc;

// What a member's join record says of its devices: their CUDA indices, and
// its maps by peer name (local index -> the peer's index).
struct DeviceOffer {
  std::vector<int> devices;
  std::map<std::string, std::map<int, int>> maps;
};

// The lines of a join record's offers that publish `devices` and `maps`
// ("devices 0,1" and "devicemap <peer> 0:1,1:0"), each after a newline;
// empty without devices.
std::string deviceOfferLines(
    const std::vector<c10::Device>& devices,
    const std::unordered_map<std::string, rpc::DeviceMap>& maps);

// Parses them back out of a member's offers (other lines are skipped; a
// malformed one reads as no map).
DeviceOffer parseDeviceOffer(const std::string& offers);

// Why `me` (publishing `mine`) cannot join beside `peer` (publishing
// `theirs`), or "": a map either way must land on a device its target
// publishes.
std::string deviceMapConflict(
    const std::string& me,
    const DeviceOffer& mine,
    const std::string& peer,
    const DeviceOffer& theirs);

// The map our responses to `peer` take: the reverse of its map to `me`.
rpc::DeviceMap reverseMapOf(
    const DeviceOffer& peerOffer,
    const std::string& me);

} // namespace torch_rpc_ext
