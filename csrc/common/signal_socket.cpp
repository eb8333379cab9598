// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/signal_socket.h"

#include <sys/socket.h>
#include <cerrno>
#include <stdexcept>
#include <vector>

#include "csrc/common/fd_closer.h"
#include "csrc/common/logging.h"

namespace torch_rpc_ext {

SignalPair makeSignalPair() {
  int pair[2];
  if (::socketpair(
          AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, pair) != 0) {
    throw std::runtime_error(errnoText("socketpair for a wake-up failed"));
  }
  return SignalPair{pair[0], pair[1]};
}

bool sendSignal(int fd) {
  const char byte = 1;
  if (::send(fd, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL) == 1) {
    return true;
  }
  return errno == EAGAIN || errno == EWOULDBLOCK;
}

SignalDrain drainSignals(int fd) {
  char bytes[16 << 10];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  std::vector<int> fds;
  for (int i = 0; i < 16; ++i) {
    iovec iov{bytes, sizeof(bytes)};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t got = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (got > 0) {
      collectPassedFds(msg, fds);
      // (Truncated: descriptors came that could not be installed, e.g.
      // our table is full; the kernel closed those.)
      if (!fds.empty() || (msg.msg_flags & MSG_CTRUNC) != 0) {
        closeOffThread(fds);
        return SignalDrain::kDescriptors;
      }
      if (static_cast<size_t>(got) < sizeof(bytes)) {
        // All that was queued, or up to a byte the kernel does not glue to
        // these (one carrying descriptors): either way what is left keeps
        // the descriptor readable, and every watcher of ours is
        // level-triggered. Not asking again until EAGAIN halves a wake-up's
        // system calls (a woken loop drains one or two bytes).
        return SignalDrain::kOpen;
      }
      continue;
    }
    if (got == 0) {
      return SignalDrain::kEnded;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      return SignalDrain::kOpen;
    }
    return SignalDrain::kEnded;
  }
  return SignalDrain::kOpen;
}

const char* signalMisuseText(SignalDrain drain) {
  switch (drain) {
    case SignalDrain::kEnded:
      return "shut down";
    case SignalDrain::kDescriptors:
      return "sent descriptors over";
    case SignalDrain::kOpen:
      break;
  }
  return "used";
}

bool isSignalSocket(int fd) {
  // getsockopt() only: it fails at once (ENOTSOCK) for anything but a
  // socket, where fstat() would ask the file's filesystem.
  int domain = 0;
  int type = 0;
  socklen_t len = sizeof(int);
  if (fd < 0 || ::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0) {
    return false;
  }
  len = sizeof(int);
  return ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 &&
      domain == AF_UNIX && type == SOCK_STREAM;
}

} // namespace torch_rpc_ext
