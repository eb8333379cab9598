// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <string>

#include "csrc/transport/stream/transport.h"

namespace torch_rpc_ext::transport::shm {

// The shm transport (connection.h) over the shared stream core. Viable where
// this host can be named; two processes reach each other exactly when they
// run on one booted kernel in one network namespace (the domain
// descriptor), i.e. when one can reach the other's abstract sockets. Its
// connections pass descriptors: the shm channels' shared memory rides on
// them.
class ShmTransport final : public stream::StreamTransport {
 public:
  explicit ShmTransport(TransportOptions options);
  ~ShmTransport() override;

  std::string name() const override;
  std::string unviableReason() const override {
    return unviable_;
  }
  std::string domainDescriptor() const override {
    return domain_;
  }
  bool crossesHosts() const override {
    return false;
  }
  bool passesDescriptors() const override {
    return true;
  }
  std::shared_ptr<Listener> listen() override;

 protected:
  std::shared_ptr<stream::StreamConnection> newConnection(
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer) override;

 private:
  std::string domain_;
  std::string unviable_;
};

} // namespace torch_rpc_ext::transport::shm
