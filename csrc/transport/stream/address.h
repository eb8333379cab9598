// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/socket.h>

#include <string>

namespace torch_rpc_ext::transport::stream {

// A numeric IPv4 or IPv6 endpoint, or an abstract Unix socket ("@name").
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;

  // "1.2.3.4:5", "[::1]:5" or "@name". Throws std::invalid_argument
  // naming the text.
  static SocketAddress parse(const std::string& hostPort);
  // The abstract-namespace Unix socket `name` (Linux).
  static SocketAddress unixAbstract(const std::string& name);
  // `host` is an IP literal; port 0 asks the kernel for one.
  static SocketAddress fromHost(const std::string& host, int port);
  // The local or remote address of a socket.
  static SocketAddress ofSocket(int fd, bool peer);

  int family() const {
    return storage.ss_family;
  }
  std::string str() const;
};

// The address this host advertises by default: the environment's
// TORCH_RPC_EXT_ADDR, else the first IPv4 address of the interface named by
// TORCH_RPC_EXT_SOCKET_IFNAME, else the IPv4 address the hostname resolves
// to when it is not loopback, else 127.0.0.1.
std::string defaultAdvertisedAddress();

// The first IPv4 address of interface `name`; throws if it has none.
std::string interfaceAddress(const std::string& name);

} // namespace torch_rpc_ext::transport::stream
