// SPDX-License-Identifier: BSD-3-Clause
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "csrc/common/fd_closer.h"
#include "csrc/common/logging.h"
#include "csrc/transport/stream/listener.h"
#include "csrc/transport/stream/transport.h"

namespace torch_rpc_ext::transport::stream {

namespace {
// Sockets accepted per wake-up at most; the rest wait for the next round,
// after the loop has served the events of everything else.
constexpr int kMaxAcceptsPerWake = 32;
} // namespace

StreamListener::StreamListener(
    StreamTransport& transport,
    const SocketAddress& at,
    const std::string& shown,
    const std::string& hint)
    : transport_(transport) {
  fd_ = ::socket(at.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) {
    throw std::runtime_error(
        std::string("socket() failed: ") + std::strerror(errno));
  }
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd_, reinterpret_cast<const sockaddr*>(&at.storage), at.length) !=
          0 ||
      ::listen(fd_, SOMAXCONN) != 0) {
    int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error(
        "torch_rpc_ext cannot listen on " + shown + ": " + std::strerror(err) +
        hint);
  }
  address_ = SocketAddress::ofSocket(fd_, /*peer=*/false).str();
  local_ = at.family() == AF_UNIX;
}

StreamListener::~StreamListener() {
  // Connections still in the backlog go with it, and with them what their
  // peers sent, descriptors included (fd_closer.h). (A listener has no
  // queue of its own to measure: always a closer.)
  if (fd_ >= 0) {
    closeOffThread(fd_);
  }
}

void StreamListener::start(ConnectionObserver* observer) {
  auto self = shared_from_this();
  transport_.loop().post([self, observer] {
    if (self->closed_ || self->started_) {
      return;
    }
    self->observer_ = observer;
    self->started_ = true;
    self->watchFromLoop();
  });
}

void StreamListener::close() {
  auto self = shared_from_this();
  auto finish = [self] {
    if (self->closed_) {
      return;
    }
    self->closed_ = true;
    if (self->started_ && !self->paused_) {
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

void StreamListener::handleEventsFromLoop(uint32_t /*events*/) {
  for (int n = 0; n < kMaxAcceptsPerWake && !closed_; ++n) {
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    int fd = ::accept4(
        fd_,
        reinterpret_cast<sockaddr*>(&peer),
        &len,
        SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (err == EINTR || err == ECONNABORTED) {
        continue;
      }
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        pauseFromLoop(err);
      } else if (err != EAGAIN && err != EWOULDBLOCK) {
        logWarningLimited(
            "accept",
            std::string("torch_rpc_ext: accept failed: ") + std::strerror(err));
      }
      return;
    }
    pause_ = std::chrono::milliseconds(50); // a socket came: not exhausted
    if (local_ && !localPeerAllowed(fd)) {
      // Unanswered; it may already hold a message with descriptors, whose
      // last close could wait (fd_closer.h).
      closeSocket(fd);
      continue;
    }
    transport_.acceptedFromLoop(
        fd, SocketAddress::ofSocket(fd, /*peer=*/true).str(), observer_);
  }
}

bool StreamListener::localPeerAllowed(int fd) const {
  std::string refusal =
      localPeerRefusal(fd, transport_.options().localPeersAnyUser);
  if (refusal.empty()) {
    return true;
  }
  logWarningLimited(
      "peercred",
      "torch_rpc_ext: refused a local connection to " + address_ + ": " +
          refusal);
  return false;
}

void StreamListener::pauseFromLoop(int error) {
  const bool made = transport_.closeOldestUnauthenticatedFromLoop(
      "closed before it authenticated: the process ran out of descriptors");
  logWarningLimited(
      "accept_exhausted",
      "torch_rpc_ext: accept on " + address_ +
          " failed: " + std::strerror(error) + "; not accepting for " +
          std::to_string(pause_.count()) + " ms" +
          (made ? " (closed the oldest connection that had not authenticated)"
                : ""));
  if (paused_ || closed_) {
    return;
  }
  paused_ = true;
  transport_.loop().removeFromLoop(fd_);
  auto self = shared_from_this();
  transport_.loop().runAfter(pause_, [self] { self->watchFromLoop(); });
  pause_ = std::min(pause_ * 2, std::chrono::milliseconds(1000));
}

void StreamListener::watchFromLoop() {
  paused_ = false;
  if (closed_) {
    return;
  }
  try {
    transport_.loop().addFromLoop(fd_, shared_from_this(), EPOLLIN);
  } catch (const std::exception& e) {
    // Until session 97 the error escaped into the loop's log and the
    // listener was never watched again: every dial to this worker failed
    // its handshake for the life of the process.
    logWarningLimited(
        "listener_watch",
        "torch_rpc_ext: not accepting on " + address_ + " for " +
            std::to_string(pause_.count()) + " ms: " + e.what());
    paused_ = true;
    auto self = shared_from_this();
    transport_.loop().runAfter(pause_, [self] { self->watchFromLoop(); });
    pause_ = std::min(pause_ * 2, std::chrono::milliseconds(1000));
  }
}

} // namespace torch_rpc_ext::transport::stream
