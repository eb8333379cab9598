// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/transport.h"

#include "csrc/transport/stream/address.h"
#include "csrc/transport/tcp/connection.h"
#include "csrc/transport/tcp/listener.h"

namespace torch_rpc_ext::transport::tcp {

TcpTransport::TcpTransport(
    TransportOptions options,
    std::shared_ptr<const TlsContext> tls)
    : StreamTransport(std::move(options)), tls_(std::move(tls)) {}

TcpTransport::~TcpTransport() {
  stop();
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
  return stream::routeFrom(bindHost(), address);
}

std::shared_ptr<Listener> TcpTransport::listen() {
  auto l = std::make_shared<TcpListener>(*this);
  adoptListener(l);
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
