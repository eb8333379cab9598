// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "csrc/transport/stream/transport.h"

namespace torch_rpc_ext::transport::tcp {

// TCP over the shared stream core: works across hosts. Listens on
// TransportOptions::bindAddress, else stream::defaultAdvertisedAddress().
class TcpTransport final : public stream::StreamTransport {
 public:
  // `tls`: TlsContext::create(options.tls, options.secret) (null: never
  // encrypts).
  TcpTransport(TransportOptions options, std::shared_ptr<const TlsContext> tls);
  ~TcpTransport() override;

  std::string name() const override;
  std::string unviableReason() const override {
    return {};
  }
  // Any two TCP endpoints may try to connect; routing decides the rest.
  std::string domainDescriptor() const override;
  bool crossesHosts() const override {
    return true;
  }
  bool passesDescriptors() const override {
    return false;
  }
  std::shared_ptr<Listener> listen() override;
  // What the listener binds and advertises: TransportOptions::bindAddress,
  // else stream::defaultAdvertisedAddress().
  std::string bindHost() const;

 protected:
  std::shared_ptr<stream::StreamConnection> newConnection(
      int fd,
      bool outbound,
      int32_t expectedPeerId,
      std::string peerAddress,
      ConnectionObserver* observer) override;
  // The same family as ours; a link-local peer through our own interface
  // (stream::routeFrom).
  std::string routeTo(const std::string& address) const override;
  // tls_key_updates: KeyUpdates asked for (TlsOptions::keyUpdateBytes);
  // tls_handshakes, tls_handshake_failures: TLS handshakes that completed
  // and that failed, both ends.
  void addCounters(std::map<std::string, uint64_t>& out) const override;

 private:
  // Encrypts its connections as TransportOptions::tls says (null: never).
  const std::shared_ptr<const TlsContext> tls_;
  // The host the listener bound (set by listen(); empty before).
  mutable std::mutex selfMutex_;
  std::string listeningHost_;
};

} // namespace torch_rpc_ext::transport::tcp
