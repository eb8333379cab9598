// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <string>

#include "csrc/transport/shm/slab.h"
#include "csrc/transport/stream/transport.h"

namespace torch_rpc_ext::transport::shm {

// The shm transport (connection.h) over the shared stream core. Viable where
// memfds work and this host can be named; two processes reach each other
// exactly when they run on one booted kernel in one network namespace (the
// domain descriptor), i.e. when one can reach the other's abstract sockets.
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
  std::shared_ptr<Listener> listen() override;

 protected:
  std::shared_ptr<stream::StreamConnection> newConnection(
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer) override;
  void addCounters(std::map<std::string, uint64_t>& out) const override;

 private:
  std::string domain_;
  std::string unviable_;
  SlabCounters counters_;
};

} // namespace torch_rpc_ext::transport::shm
