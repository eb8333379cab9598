// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/listener.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "csrc/common/crypto.h"
#include "csrc/common/logging.h"
#include "csrc/transport/shm/ring.h"
#include "csrc/transport/tcp/address.h"
#include "csrc/transport/tcp/connection.h"
#include "csrc/transport/tcp/transport.h"

namespace torch_rpc_ext::transport::tcp {

namespace {

std::string toHex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

} // namespace

TcpListener::TcpListener(TcpTransport& transport) : transport_(transport) {
  std::string host = transport.options().bindAddress;
  SocketAddress at;
  if (transport.isShm()) {
    // A fresh abstract name: nothing on disk to clean up, gone with us.
    host = "@torch_rpc_ext-" + std::to_string(::getpid()) + "-" +
        toHex(randomBytes(8));
    at = SocketAddress::parse(host);
    // Fail here, not on first use, if shared memory is unavailable.
    shm::Ring::create(shm::kMinRingBytes);
  } else {
    at = SocketAddress::fromHost(host, 0);
  }
  fd_ = ::socket(at.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) {
    throw std::runtime_error(
        std::string("socket() failed: ") + std::strerror(errno));
  }
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&at.storage), at.length) != 0 ||
      ::listen(fd_, SOMAXCONN) != 0) {
    int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error(
        "torch_rpc_ext cannot listen on " + host + ": " + std::strerror(err) +
        " (set the `address` option or TORCH_RPC_EXT_ADDR / "
        "TORCH_RPC_EXT_SOCKET_IFNAME to an address of this host)");
  }
  address_ = SocketAddress::ofSocket(fd_, /*peer=*/false).str();
}

TcpListener::~TcpListener() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

void TcpListener::start(ConnectionObserver* observer) {
  auto self = shared_from_this();
  transport_.loop().post([self, observer] {
    if (self->closed_ || self->started_) {
      return;
    }
    self->observer_ = observer;
    self->started_ = true;
    self->transport_.loop().addFromLoop(self->fd_, self, EPOLLIN);
  });
}

void TcpListener::close() {
  auto self = shared_from_this();
  auto finish = [self] {
    if (self->closed_) {
      return;
    }
    self->closed_ = true;
    if (self->started_) {
      self->transport_.loop().removeFromLoop(self->fd_);
    }
    ::shutdown(self->fd_, SHUT_RDWR);
  };
  if (transport_.loop().inLoop()) {
    finish();
  } else {
    transport_.loop().post(finish);
  }
}

void TcpListener::handleEventsFromLoop(uint32_t /*events*/) {
  while (!closed_) {
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    int fd = ::accept4(
        fd_, reinterpret_cast<sockaddr*>(&peer), &len,
        SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) {
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        logWarning(
            std::string("torch_rpc_ext: accept failed: ") +
            std::strerror(errno));
      }
      return;
    }
    auto conn = TcpConnection::acceptFromLoop(
        transport_.loop(), transport_.options(), fd,
        SocketAddress::ofSocket(fd, /*peer=*/true).str(), observer_,
        transport_.isShm());
    transport_.adopt(conn);
  }
}

} // namespace torch_rpc_ext::transport::tcp
