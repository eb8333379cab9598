// SPDX-License-Identifier: BSD-3-Clause
// The one file that knows every transport: a new transport is a folder of
// its own plus one line in kTransports.
#include "csrc/transport/registry.h"

#include <stdexcept>

#include "csrc/transport/shm/factory.h"
#include "csrc/transport/stream/address.h"
#include "csrc/transport/tcp/factory.h"

namespace torch_rpc_ext::transport {

namespace {

struct Entry {
  const char* name;
  std::shared_ptr<Transport> (*create)(const TransportOptions&);
};

// In default preference order: the first one two peers share is used.
constexpr Entry kTransports[] = {
    {"shm", shm::create},
    {"tcp", tcp::create},
};

} // namespace

std::vector<std::string> transportNames() {
  std::vector<std::string> names;
  for (const auto& e : kTransports) {
    names.emplace_back(e.name);
  }
  return names;
}

std::shared_ptr<Transport> createTransport(
    const std::string& name,
    const TransportOptions& options) {
  for (const auto& e : kTransports) {
    if (name == e.name) {
      return e.create(options);
    }
  }
  throw std::invalid_argument("unknown transport '" + name + "'");
}

std::string defaultAdvertisedAddress() {
  return stream::defaultAdvertisedAddress();
}

} // namespace torch_rpc_ext::transport
