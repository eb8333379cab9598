// SPDX-License-Identifier: BSD-3-Clause
// The one file that knows every channel: a new channel is a folder of its own
// (or a class in one) plus one line in kChannels.
#include "csrc/channel/registry.h"

#include <stdexcept>

#include "csrc/channel/shm/factory.h"

namespace torch_rpc_ext::channel {

namespace {

struct Entry {
  const char* name;
  std::shared_ptr<Context> (*create)();
};

// In default preference order: a segment is offered to the channels of its
// device in this order, and the stream takes what none took.
constexpr Entry kChannels[] = {
    {"shm_slab", shm::createSlabChannel},
    {"shm_ring", shm::createRingChannel},
};

} // namespace

std::vector<std::string> channelNames() {
  std::vector<std::string> names;
  for (const auto& e : kChannels) {
    names.emplace_back(e.name);
  }
  return names;
}

std::shared_ptr<Context> createChannel(const std::string& name) {
  for (const auto& e : kChannels) {
    if (name == e.name) {
      return e.create();
    }
  }
  throw std::invalid_argument("unknown channel '" + name + "'");
}

} // namespace torch_rpc_ext::channel
