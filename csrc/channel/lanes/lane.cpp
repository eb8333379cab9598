// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/channel/lanes/lane.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace torch_rpc_ext::channel::lanes {

namespace {

constexpr int kLaneBufferBytes = 4 << 20;
constexpr int kDialSliceMs = 100;

std::string errnoWhy(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

} // namespace

void laneNonce(uint16_t lane, uint64_t sequence, uint8_t out[12]) {
  std::memset(out, 0, 12);
  std::memcpy(out, &lane, sizeof(lane));
  std::memcpy(out + 4, &sequence, sizeof(sequence));
}

std::string helloKey(std::string_view laneSecret) {
  return hkdfExpand(laneSecret, "torch_rpc_ext tcp_lanes/2 hello", 32);
}

void helloMac(
    std::string_view helloKey,
    const uint8_t challenge[kChallengeBytes],
    uint16_t lane,
    const uint8_t ticket[kTicketBytes],
    uint8_t out[kHelloMacBytes]) {
  std::string message("torch_rpc_ext tcp_lanes/2 hello mac");
  message.append(reinterpret_cast<const char*>(challenge), kChallengeBytes);
  message.append(reinterpret_cast<const char*>(&lane), sizeof(lane));
  message.append(reinterpret_cast<const char*>(ticket), kTicketBytes);
  Digest d = hmacSha256(helloKey, message);
  std::memcpy(out, d.data(), kHelloMacBytes);
}

LaneCipher::LaneCipher(
    std::string laneSecret,
    uint16_t lane,
    uint32_t recordsPerKey,
    std::atomic<uint64_t>* rekeys)
    : secret_(std::move(laneSecret)),
      lane_(lane),
      recordsPerKey_(recordsPerKey == 0 ? 1 : recordsPerKey),
      rekeys_(rekeys) {}

void LaneCipher::next(uint8_t nonce[Aead::kNonceBytes]) {
  if (sequence_ % recordsPerKey_ == 0) {
    uint64_t epoch = sequence_ / recordsPerKey_;
    std::string info("torch_rpc_ext tcp_lanes/2 record key");
    info.append(reinterpret_cast<const char*>(&lane_), sizeof(lane_));
    info.append(reinterpret_cast<const char*>(&epoch), sizeof(epoch));
    aead_ = std::make_unique<Aead>(hkdfExpand(secret_, info, Aead::kKeyBytes));
    if (epoch > 0 && rekeys_ != nullptr) {
      rekeys_->fetch_add(1, std::memory_order_relaxed);
    }
  }
  laneNonce(lane_, sequence_++, nonce);
}

void LaneCipher::seal(
    std::string_view aad,
    const void* in,
    void* out,
    size_t size,
    uint8_t* tag) {
  uint8_t nonce[Aead::kNonceBytes];
  next(nonce);
  aead_->seal(nonce, aad, in, out, size, tag);
}

bool LaneCipher::open(
    std::string_view aad,
    const void* in,
    void* out,
    size_t size,
    const uint8_t* tag) {
  uint8_t nonce[Aead::kNonceBytes];
  next(nonce);
  return aead_->open(nonce, aad, in, out, size, tag);
}

std::string describeAddress(const sockaddr_storage& address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(address);
    ::inet_ntop(AF_INET, &a.sin_addr, text, sizeof(text));
    return std::string(text) + ":" + std::to_string(ntohs(a.sin_port));
  }
  if (address.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(address);
    ::inet_ntop(AF_INET6, &a.sin6_addr, text, sizeof(text));
    std::string host = text;
    char name[IF_NAMESIZE] = {};
    if (a.sin6_scope_id != 0 && ::if_indextoname(a.sin6_scope_id, name)) {
      host += std::string("%") + name;
    }
    return "[" + host + "]:" + std::to_string(ntohs(a.sin6_port));
  }
  return "(address family " + std::to_string(address.ss_family) + ")";
}

void tuneLaneSocket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int size = kLaneBufferBytes;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
}

int dialLane(
    const sockaddr_storage& address,
    int timeoutMs,
    const std::function<bool()>& cancelled,
    std::string* error) {
  int fd = ::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = errnoWhy("socket failed");
    return -1;
  }
  tuneLaneSocket(fd);
  int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  socklen_t len =
      address.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), len);
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    for (int waited = 0; true; waited += kDialSliceMs) {
      rc = ::poll(&p, 1, kDialSliceMs);
      if (rc > 0 || (rc < 0 && errno != EINTR)) {
        break;
      }
      if (cancelled()) {
        *error = "closing";
        ::close(fd);
        return -1;
      }
      if (waited >= timeoutMs) {
        *error = "connect timed out after " + std::to_string(timeoutMs) + " ms";
        ::close(fd);
        return -1;
      }
    }
    if (rc < 0) {
      *error = errnoWhy("poll failed");
      ::close(fd);
      return -1;
    }
    int soError = 0;
    socklen_t soLen = sizeof(soError);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soError, &soLen);
    errno = soError;
    rc = soError == 0 ? 0 : -1;
  }
  if (rc != 0) {
    *error = errnoWhy("connect failed");
    ::close(fd);
    return -1;
  }
  ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

bool sendAll(int fd, const void* data, size_t size, std::string* error) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      *error = errnoWhy("send failed");
      return false;
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool recvAll(int fd, void* data, size_t size, std::string* error) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::recv(fd, p, size, MSG_WAITALL);
    if (n == 0) {
      *error = "closed";
      return false;
    }
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      *error = errnoWhy("recv failed");
      return false;
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool recvWithin(
    int fd,
    void* data,
    size_t size,
    int timeoutMs,
    const std::function<bool()>& cancelled,
    std::string* error) {
  char* p = static_cast<char*>(data);
  auto due =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
  while (size > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    due - std::chrono::steady_clock::now())
                    .count();
    if (cancelled()) {
      *error = "closing";
      return false;
    }
    pollfd pf{fd, POLLIN, 0};
    int rc = left > 0
        ? ::poll(
              &pf, 1, static_cast<int>(std::min<int64_t>(left, kDialSliceMs)))
        : 0;
    if (rc == 0) {
      if (left > kDialSliceMs) {
        continue;
      }
      *error = "timed out";
      return false;
    }
    if (rc < 0) {
      if (errno == EINTR) {
        continue;
      }
      *error = errnoWhy("poll failed");
      return false;
    }
    ssize_t n = ::recv(fd, p, size, MSG_DONTWAIT);
    if (n == 0) {
      *error = "closed";
      return false;
    }
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) {
        continue;
      }
      *error = errnoWhy("recv failed");
      return false;
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

uint16_t portOf(const sockaddr_storage& address) {
  return ntohs(
      address.ss_family == AF_INET6
          ? reinterpret_cast<const sockaddr_in6&>(address).sin6_port
          : reinterpret_cast<const sockaddr_in&>(address).sin_port);
}

void setPort(sockaddr_storage* address, uint16_t port) {
  if (address->ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(address)->sin6_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in*>(address)->sin_port = htons(port);
  }
}

int bindAnyPort(
    const sockaddr_storage& local,
    uint16_t* port,
    std::string* error) {
  sockaddr_storage address = local;
  setPort(&address, 0);
  socklen_t length =
      local.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  int fd = ::socket(local.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = std::string("socket failed: ") + std::strerror(errno);
    return -1;
  }
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), length) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    *error = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  *port = portOf(address);
  return fd;
}

} // namespace torch_rpc_ext::channel::lanes
