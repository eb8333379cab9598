// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/shm/transport.h"

#include <unistd.h>

#include <stdexcept>

#include "csrc/common/host.h"
#include "csrc/transport/shm/connection.h"
#include "csrc/transport/shm/listener.h"

namespace torch_rpc_ext::transport::shm {

namespace {

// Equal in two processes exactly when they run on the same booted kernel in
// the same network namespace. Empty if unknown.
std::string thisHost() {
  const std::string& boot = bootId();
  char ns[128] = {};
  ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  if (boot.empty() || n <= 0) {
    return {};
  }
  return boot + "/" + std::string(ns, static_cast<size_t>(n));
}

} // namespace

ShmTransport::ShmTransport(TransportOptions options)
    : StreamTransport(std::move(options), "rpcx-shm"), domain_(thisHost()) {
  if (domain_.empty()) {
    unviable_ = "cannot identify this host";
  }
}

ShmTransport::~ShmTransport() {
  stop();
}

std::string ShmTransport::name() const {
  return "shm";
}

std::shared_ptr<Listener> ShmTransport::listen() {
  if (!unviable_.empty()) {
    throw std::runtime_error("the shm transport is unusable: " + unviable_);
  }
  auto l = std::make_shared<ShmListener>(*this);
  adoptListener(l);
  return l;
}

std::shared_ptr<stream::StreamConnection> ShmTransport::newConnection(
    int fd,
    bool outbound,
    int32_t expectedPeerId,
    std::string peerAddress,
    ConnectionObserver* observer) {
  return std::make_shared<ShmConnection>(
      loop(),
      options_,
      fd,
      outbound,
      expectedPeerId,
      std::move(peerAddress),
      observer);
}

} // namespace torch_rpc_ext::transport::shm
