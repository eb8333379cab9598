// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "csrc/transport/stream/address.h"
#include "csrc/transport/stream/loop.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::stream {

class StreamTransport;

// A listening stream socket bound to the address its backend chose. Once
// start() is called it accepts on the loop thread, at most a bounded batch
// per wake-up, and hands each socket to its transport, which starts the
// connection's handshake at once: a storm of incoming connections is served
// side by side, one bounded step at a time, never one connection to the end
// before the next.
class StreamListener : public Listener,
                       public Pollable,
                       public std::enable_shared_from_this<StreamListener> {
 public:
  ~StreamListener() override;

  std::string address() const override {
    return address_;
  }
  void start(ConnectionObserver* observer) override;
  void close() override;
  void handleEventsFromLoop(uint32_t events) override;

 protected:
  // Binds and listens on `at` now; throws std::runtime_error naming `shown`
  // (the address as the user gave it), the system's reason and `hint`.
  StreamListener(
      StreamTransport& transport,
      const SocketAddress& at,
      const std::string& shown,
      const std::string& hint);

 private:
  StreamTransport& transport_;
  int fd_ = -1;
  std::string address_;
  // Whether a socket accepted from a local peer may stay: its process runs
  // as our user or root, or TransportOptions::localPeersAnyUser.
  bool localPeerAllowed(int fd) const;
  // Out of descriptors or memory: accepting again at once would find the
  // same, and the level-triggered loop would spin. Stop watching the socket
  // for `pause_` (doubling up to 1 s while it lasts), closing the oldest
  // unauthenticated connection to make room.
  void pauseFromLoop(int error);
  // Watch the socket (again): where the kernel refuses (the pressure that
  // paused it: ENOMEM, fs.epoll.max_user_watches), try again after
  // `pause_` rather than stop accepting for good.
  void watchFromLoop();

  ConnectionObserver* observer_ = nullptr;
  bool started_ = false;
  bool closed_ = false;
  bool paused_ = false;
  bool local_ = false; // a Unix socket
  std::chrono::milliseconds pause_{50};
};

} // namespace torch_rpc_ext::transport::stream
