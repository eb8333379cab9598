// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/socket.h>

#include <string>

namespace torch_rpc_ext::transport::stream {

// A numeric IPv4 or IPv6 endpoint, or an abstract Unix socket ("@name").
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;

  // "1.2.3.4:5", "[::1]:5", "[fe80::1%eth0]:5" (a link-local address and
  // the interface it is on, by name or index) or "@name". Throws
  // std::invalid_argument naming the text.
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

// The address of interface `name` by preference: its first IPv4 address,
// else a global or unique-local IPv6 one, else its link-local IPv6 address
// ("fe80::...%name"); throws if it has none.
std::string interfaceAddress(const std::string& name);

// The address to connect to `peer` (an advertised "host:port") from a
// worker that listens on `self` (an IP literal): `peer` itself, or for a
// link-local IPv6 `peer` the same address with our own interface as its
// scope (the scope it was advertised with names the peer's interface).
// Throws std::invalid_argument saying why `peer` cannot be reached from
// `self`: a different family, or a link-local peer and a worker that has no
// link-local address.
std::string routeFrom(const std::string& self, const std::string& peer);

// Whether the process at the other end of Unix socket `fd` may talk to us
// (SO_PEERCRED: our user or root, unless `anyUser`): "" if so, else why not.
// For an accepted socket, the process that connected; for a connected one,
// the one that listens (another user may bind the abstract name a worker
// that exited had, and take our hello and proof).
std::string localPeerRefusal(int fd, bool anyUser);

} // namespace torch_rpc_ext::transport::stream
