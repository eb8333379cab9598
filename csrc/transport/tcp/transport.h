// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "csrc/transport/tcp/loop.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::tcp {

class TcpConnection;
class TcpListener;

// TCP over one epoll loop thread. Works across hosts; the fallback transport.
// With `shm`, the same machinery over abstract Unix sockets with shared
// rings for bulk data (the "shm" transport, same host only).
class TcpTransport final : public Transport {
 public:
  TcpTransport(TransportOptions options, bool shm);
  ~TcpTransport() override;

  std::string name() const override {
    return shm_ ? "shm" : "tcp";
  }
  bool isShm() const {
    return shm_;
  }
  std::shared_ptr<Listener> listen() override;
  std::shared_ptr<Connection> connect(
      const std::string& address,
      int32_t expectedPeerId,
      ConnectionObserver* observer) override;
  void stop() override;
  std::map<std::string, uint64_t> counters() const override;

  // Listener: track an accepted connection so stop() closes it.
  void adopt(const std::shared_ptr<Connection>& conn);
  Loop& loop() {
    return loop_;
  }
  const TransportOptions& options() const {
    return options_;
  }

 private:
  const TransportOptions options_;
  const bool shm_;
  Loop loop_;
  std::mutex mutex_;
  bool stopped_ = false;
  std::vector<std::weak_ptr<Connection>> connections_;
  std::vector<std::shared_ptr<Listener>> listeners_;
};

} // namespace torch_rpc_ext::transport::tcp
