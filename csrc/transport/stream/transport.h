// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/common/source_strikes.h"
#include "csrc/transport/stream/loop.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext::transport::stream {

class StreamConnection;

// The lifecycle every stream backend shares: one loop thread, the listeners
// and connections to close on stop(), and the loop's counters. A backend
// says how a socket is made (family), which listener it binds and which
// connection class speaks on a socket.
class StreamTransport : public Transport {
 public:
  ~StreamTransport() override;

  std::shared_ptr<Connection> connect(
      const std::string& address,
      int32_t expectedPeerId,
      ConnectionObserver* observer) override;
  bool listenerAnswers(
      const std::string& address,
      std::chrono::milliseconds timeout) const override;
  std::vector<Knock> knock(
      const std::vector<std::string>& addresses,
      std::chrono::milliseconds timeout) const override;
  void settleChannels() override;
  bool channelsSettled() override;
  bool postToLoop(std::function<void()> fn) override;
  void stop() override;
  std::map<std::string, uint64_t> counters() const override;

  // Listener, loop thread: a socket accepted for `observer`. Closes it
  // unread where its source is held off (strikes_); keeps the
  // unauthenticated ones within the caps (TransportOptions), closing the
  // oldest first.
  void acceptedFromLoop(
      int fd,
      std::string peerAddress,
      ConnectionObserver* observer);
  // Listener, loop thread, out of descriptors: closes the oldest connection
  // that has not authenticated, if any, to make room. Whether one was.
  bool closeOldestUnauthenticatedFromLoop(const std::string& why);
  Loop& loop() {
    return loop_;
  }
  const TransportOptions& options() const {
    return options_;
  }

 protected:
  // `threadName`: its loop's threads' (Loop).
  StreamTransport(TransportOptions options, const std::string& threadName);

  // Track a listener so stop() closes it.
  void adoptListener(const std::shared_ptr<Listener>& listener);
  // A connection object for `fd` (connecting when `outbound`), not started.
  virtual std::shared_ptr<StreamConnection> newConnection(
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer) = 0;
  // The address to connect to for a peer that advertised `address`; throws
  // std::invalid_argument saying why it cannot be reached from here (the
  // connection then fails with that reason).
  virtual std::string routeTo(const std::string& address) const {
    return address;
  }
  // Counters of the backend, added to the loop's.
  virtual void addCounters(std::map<std::string, uint64_t>& out) const {}

  const TransportOptions options_;

 private:
  // Track a connection so stop() closes it.
  void adopt(const std::shared_ptr<Connection>& conn);
  // The connections still open.
  std::vector<std::shared_ptr<Connection>> liveConnections();

  // Accepted, not yet authenticated (loop thread only).
  struct Unauthenticated {
    std::weak_ptr<Connection> conn;
    std::string host;
  };
  std::deque<Unauthenticated> unauthenticated_;
  std::atomic<uint64_t> unauthenticatedClosed_{0};
  // Sources whose proofs were refused lately (SourceStrikes' limits: 8
  // within 10 s hold a source off for 30 s); shared with the accepted
  // connections, which strike.
  const std::shared_ptr<SourceStrikes> strikes_ =
      std::make_shared<SourceStrikes>();
  // The other way: servers (by the address dialed) that ended our TLS
  // handshakes unfinished after the key exchange, with the same limits; no
  // address is exempt (a hold-off keeps only this process from dialing).
  const std::shared_ptr<SourceStrikes> serverStrikes_ =
      std::make_shared<SourceStrikes>();

  Loop loop_;
  std::mutex mutex_;
  bool stopped_ = false;
  std::vector<std::weak_ptr<Connection>> connections_;
  std::vector<std::shared_ptr<Listener>> listeners_;
};

} // namespace torch_rpc_ext::transport::stream
