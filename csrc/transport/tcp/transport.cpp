// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/transport.h"

#include "csrc/transport/stream/address.h"
#include "csrc/transport/tcp/connection.h"
#include "csrc/transport/tcp/listener.h"

namespace torch_rpc_ext::transport::tcp {

TcpTransport::TcpTransport(
    TransportOptions options,
    std::shared_ptr<const TlsContext> tls)
    : StreamTransport(std::move(options), "rpcx-tcp"), tls_(std::move(tls)) {}

TcpTransport::~TcpTransport() {
  stop();
}

void TcpTransport::addCounters(std::map<std::string, uint64_t>& out) const {
  out["tls_key_updates"] = tls_ ? tls_->keyUpdates() : 0;
  out["tls_handshakes"] = tls_ ? tls_->handshakes() : 0;
  out["tls_handshake_failures"] = tls_ ? tls_->handshakeFailures() : 0;
}

std::string TcpTransport::name() const {
  return "tcp";
}

std::string TcpTransport::domainDescriptor() const {
  return "any";
}

std::string TcpTransport::bindHost() const {
  const auto& host = options_.bindAddress;
  return host.empty() ? stream::defaultAdvertisedAddress() : host;
}

std::string TcpTransport::routeTo(const std::string& address) const {
  std::string self;
  {
    std::lock_guard<std::mutex> lock(selfMutex_);
    self = listeningHost_;
  }
  return stream::routeFrom(self.empty() ? bindHost() : self, address);
}

std::shared_ptr<Listener> TcpTransport::listen() {
  auto l = std::make_shared<TcpListener>(*this);
  adoptListener(l);
  // The host part of what the listener bound ("[fe80::1%eth0]:5" ->
  // "fe80::1%eth0"): what routeTo() compares peers with, fixed from now on.
  std::string host = l->address();
  host = host.substr(0, host.rfind(':'));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::lock_guard<std::mutex> lock(selfMutex_);
  listeningHost_ = host;
  return l;
}

std::shared_ptr<stream::StreamConnection> TcpTransport::newConnection(
    int fd,
    bool outbound,
    int32_t expectedPeerId,
    std::string peerAddress,
    ConnectionObserver* observer) {
  return std::make_shared<TcpConnection>(
      loop(),
      options_,
      fd,
      outbound,
      expectedPeerId,
      std::move(peerAddress),
      observer,
      tls_);
}

} // namespace torch_rpc_ext::transport::tcp
