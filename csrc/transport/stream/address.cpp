// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/stream/address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace torch_rpc_ext::transport::stream {

SocketAddress SocketAddress::fromHost(const std::string& host, int port) {
  SocketAddress a;
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a.storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (::inet_pton(AF_INET, bare.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    a.length = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, bare.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    a.length = sizeof(sockaddr_in6);
  } else {
    throw std::invalid_argument(
        "'" + host + "' is not a numeric IPv4 or IPv6 address");
  }
  return a;
}

SocketAddress SocketAddress::unixAbstract(const std::string& name) {
  SocketAddress a;
  auto* un = reinterpret_cast<sockaddr_un*>(&a.storage);
  if (name.empty() || name.size() + 1 > sizeof(un->sun_path)) {
    throw std::invalid_argument("bad abstract socket name '" + name + "'");
  }
  un->sun_family = AF_UNIX;
  un->sun_path[0] = '\0';
  std::memcpy(un->sun_path + 1, name.data(), name.size());
  a.length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

SocketAddress SocketAddress::parse(const std::string& hostPort) {
  if (!hostPort.empty() && hostPort[0] == '@') {
    return unixAbstract(hostPort.substr(1));
  }
  auto colon = hostPort.rfind(':');
  if (colon == std::string::npos || colon + 1 == hostPort.size()) {
    throw std::invalid_argument(
        "address '" + hostPort + "' is not of the form host:port");
  }
  char* end = nullptr;
  long port = std::strtol(hostPort.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port <= 0 || port > 65535) {
    throw std::invalid_argument("address '" + hostPort + "' has a bad port");
  }
  return fromHost(hostPort.substr(0, colon), static_cast<int>(port));
}

SocketAddress SocketAddress::ofSocket(int fd, bool peer) {
  SocketAddress a;
  a.length = sizeof(a.storage);
  auto* sa = reinterpret_cast<sockaddr*>(&a.storage);
  int rv = peer ? ::getpeername(fd, sa, &a.length)
                : ::getsockname(fd, sa, &a.length);
  if (rv != 0) {
    a.length = 0;
  }
  return a;
}

std::string SocketAddress::str() const {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (family() == AF_INET) {
    auto* v4 = reinterpret_cast<const sockaddr_in*>(&storage);
    ::inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
    port = ntohs(v4->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (family() == AF_INET6) {
    auto* v6 = reinterpret_cast<const sockaddr_in6*>(&storage);
    ::inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
    port = ntohs(v6->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  if (family() == AF_UNIX) {
    auto* un = reinterpret_cast<const sockaddr_un*>(&storage);
    size_t n = length > offsetof(sockaddr_un, sun_path)
        ? length - offsetof(sockaddr_un, sun_path)
        : 0;
    if (n > 1 && un->sun_path[0] == '\0') {
      return "@" + std::string(un->sun_path + 1, n - 1);
    }
    return "unix peer";
  }
  return "?";
}

std::string interfaceAddress(const std::string& name) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) {
    throw std::runtime_error(
        std::string("getifaddrs failed: ") + std::strerror(errno));
  }
  std::string found;
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || name != it->ifa_name ||
        it->ifa_addr->sa_family != AF_INET) {
      continue;
    }
    char host[INET_ADDRSTRLEN];
    auto* v4 = reinterpret_cast<sockaddr_in*>(it->ifa_addr);
    ::inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
    found = host;
    break;
  }
  ::freeifaddrs(list);
  if (found.empty()) {
    throw std::invalid_argument(
        "network interface '" + name + "' has no IPv4 address");
  }
  return found;
}

std::string defaultAdvertisedAddress() {
  if (const char* addr = std::getenv("TORCH_RPC_EXT_ADDR"); addr && *addr) {
    return addr;
  }
  if (const char* ifname = std::getenv("TORCH_RPC_EXT_SOCKET_IFNAME");
      ifname && *ifname) {
    return interfaceAddress(ifname);
  }
  char hostname[256] = {};
  if (::gethostname(hostname, sizeof(hostname) - 1) == 0) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (::getaddrinfo(hostname, nullptr, &hints, &res) == 0) {
      std::string found;
      for (addrinfo* it = res; it != nullptr; it = it->ai_next) {
        auto* v4 = reinterpret_cast<sockaddr_in*>(it->ai_addr);
        if ((ntohl(v4->sin_addr.s_addr) >> 24) == 127) {
          continue;
        }
        char host[INET_ADDRSTRLEN];
        ::inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
        found = host;
        break;
      }
      ::freeaddrinfo(res);
      if (!found.empty()) {
        return found;
      }
    }
  }
  return "127.0.0.1";
}

} // namespace torch_rpc_ext::transport::stream
