// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>
#include <string>

#include "csrc/transport/tcp/loop.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::tcp {

class TcpTransport;

// A listening socket bound to TransportOptions::bindAddress on a port the
// kernel picks. Accepts on the loop thread once start() is called.
class TcpListener final : public Listener,
                          public Pollable,
                          public std::enable_shared_from_this<TcpListener> {
 public:
  explicit TcpListener(TcpTransport& transport);
  ~TcpListener() override;

  std::string address() const override {
    return address_;
  }
  void start(ConnectionObserver* observer) override;
  void close() override;
  void handleEventsFromLoop(uint32_t events) override;

 private:
  TcpTransport& transport_;
  int fd_ = -1;
  std::string address_;
  ConnectionObserver* observer_ = nullptr;
  bool started_ = false;
  bool closed_ = false;
};

} // namespace torch_rpc_ext::transport::tcp
