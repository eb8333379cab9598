// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/stream/address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>
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
  // An IPv6 scope: "fe80::1%eth0" (an interface name or index).
  std::string scope;
  if (auto pct = bare.find('%'); pct != std::string::npos) {
    scope = bare.substr(pct + 1);
    bare.resize(pct);
  }
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a.storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (!scope.empty()) {
    if (::inet_pton(AF_INET6, bare.c_str(), &v6->sin6_addr) != 1) {
      throw std::invalid_argument(
          "'" + host + "' is not a numeric IPv6 address with a scope");
    }
    unsigned index = ::if_nametoindex(scope.c_str());
    if (index == 0) {
      char* end = nullptr;
      unsigned long n = std::strtoul(scope.c_str(), &end, 10);
      if (*end != '\0' || n == 0) {
        throw std::invalid_argument(
            "'" + host + "': no network interface '" + scope +
            "' on this host for its scope");
      }
      index = static_cast<unsigned>(n);
    }
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    v6->sin6_scope_id = index;
    a.length = sizeof(sockaddr_in6);
    return a;
  }
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
    // A link-local address means nothing without its interface.
    std::string scope;
    if (v6->sin6_scope_id != 0) {
      char name[IF_NAMESIZE] = {};
      scope = "%" +
          std::string(
                  ::if_indextoname(v6->sin6_scope_id, name) != nullptr
                      ? name
                      : std::to_string(v6->sin6_scope_id).c_str());
    }
    return "[" + std::string(host) + scope + "]:" + std::to_string(port);
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
  // By preference: IPv4, a global or unique-local IPv6, a link-local IPv6
  // (with the interface as its scope).
  std::string found[3];
  for (ifaddrs* it = list; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || name != it->ifa_name) {
      continue;
    }
    char host[INET6_ADDRSTRLEN];
    if (it->ifa_addr->sa_family == AF_INET && found[0].empty()) {
      auto* v4 = reinterpret_cast<sockaddr_in*>(it->ifa_addr);
      ::inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
      found[0] = host;
    } else if (it->ifa_addr->sa_family == AF_INET6) {
      const auto& in6 =
          reinterpret_cast<sockaddr_in6*>(it->ifa_addr)->sin6_addr;
      ::inet_ntop(AF_INET6, &in6, host, sizeof(host));
      bool linkLocal = IN6_IS_ADDR_LINKLOCAL(&in6);
      std::string& slot = found[linkLocal ? 2 : 1];
      if (slot.empty() && !IN6_IS_ADDR_LOOPBACK(&in6)) {
        slot = linkLocal ? std::string(host) + "%" + name : host;
      }
    }
  }
  ::freeifaddrs(list);
  for (const auto& f : found) {
    if (!f.empty()) {
      return f;
    }
  }
  throw std::invalid_argument(
      "network interface '" + name + "' has no IPv4 or IPv6 address");
}

std::string routeFrom(const std::string& self, const std::string& peer) {
  SocketAddress ours = SocketAddress::fromHost(self, 0);
  // The scope a peer advertised names an interface of its host, not ours:
  // it is dropped here (and ours put in its place below).
  std::string unscoped = peer;
  if (auto pct = unscoped.find('%'); pct != std::string::npos) {
    auto close = unscoped.find(']', pct);
    if (unscoped.front() != '[' || close == std::string::npos) {
      throw std::invalid_argument(
          "address '" + peer +
          "': an IPv6 scope goes inside the brackets, as in "
          "[fe80::1%eth0]:29500");
    }
    unscoped.erase(pct, close - pct);
  }
  SocketAddress to = SocketAddress::parse(unscoped);
  auto family = [](const SocketAddress& a) {
    return a.family() == AF_INET ? "IPv4" : "IPv6";
  };
  if (ours.family() != to.family()) {
    throw std::invalid_argument(
        "cannot reach " + peer + " (" + family(to) +
        ") from this worker's address " + self + " (" + family(ours) +
        "): every worker of a group must listen on addresses of one family "
        "(the `address` option, TORCH_RPC_EXT_ADDR or "
        "TORCH_RPC_EXT_SOCKET_IFNAME)");
  }
  if (to.family() != AF_INET6) {
    return peer;
  }
  auto& in6 = reinterpret_cast<sockaddr_in6*>(&to.storage)->sin6_addr;
  if (!IN6_IS_ADDR_LINKLOCAL(&in6)) {
    return peer;
  }
  // A link-local address's scope is the interface of the host that wrote
  // it: ours is the one we listen on, which must be on the same link.
  auto scope = reinterpret_cast<sockaddr_in6*>(&ours.storage)->sin6_scope_id;
  const auto& own = reinterpret_cast<sockaddr_in6*>(&ours.storage)->sin6_addr;
  if (!IN6_IS_ADDR_LINKLOCAL(&own) || scope == 0) {
    throw std::invalid_argument(
        "cannot reach the link-local address " + peer +
        " from this worker's address " + self +
        ": a link-local address is reachable only over its link; give "
        "this worker a link-local address of that link (fe80::...%<interface>)"
        " or give every worker a global or unique-local one");
  }
  reinterpret_cast<sockaddr_in6*>(&to.storage)->sin6_scope_id = scope;
  return to.str();
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

std::string localPeerRefusal(int fd, bool anyUser) {
  if (anyUser) {
    return {};
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return std::string("SO_PEERCRED failed (") + std::strerror(errno) + ")";
  }
  const uid_t self = ::geteuid();
  if (cred.uid == self || cred.uid == 0) {
    return {};
  }
  return "its process (pid " + std::to_string(cred.pid) + ") runs as uid " +
      std::to_string(cred.uid) + ", this worker as uid " +
      std::to_string(self) +
      " (RpcExtBackendOptions(shm_peers_any_user=True) admits other users)";
}

} // namespace torch_rpc_ext::transport::stream
