// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/process_watch.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <string>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 // (the same number on every architecture)
#endif

namespace torch_rpc_ext {

namespace {
// The kernel's ceiling for PIDs (PID_MAX_LIMIT on 64-bit: 2^22).
constexpr long kPidMaxLimit = 1L << 22;

// Without a pidfd: the PID exists and is not a zombie (an exited process
// its parent has not reaped still answers kill()).
bool pidRuns(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno != EPERM) {
    return false;
  }
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::ifstream stat(path);
  std::string line;
  if (!std::getline(stat, line)) {
    return true; // (no /proc: kill()'s word)
  }
  // "pid (comm) S ...": comm may hold anything, ")" included.
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) {
    return true;
  }
  const char state = line[close + 2];
  return state != 'Z' && state != 'X';
}
} // namespace

std::shared_ptr<const ProcessWatch> ProcessWatch::open(const std::string& pid) {
  if (pid.empty() || pid.size() > 10 ||
      pid.find_first_not_of("0123456789") != std::string::npos) {
    return nullptr;
  }
  const long n = std::strtol(pid.c_str(), nullptr, 10);
  if (n <= 1 || n > kPidMaxLimit || n == ::getpid()) {
    return nullptr;
  }
  // (A pidfd is close-on-exec from the start.)
  const int fd =
      static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(n), 0U));
  if (fd < 0 && errno == ESRCH) {
    return nullptr;
  }
  if (fd < 0 && !pidRuns(static_cast<pid_t>(n))) {
    return nullptr;
  }
  return std::shared_ptr<const ProcessWatch>(
      new ProcessWatch(static_cast<pid_t>(n), fd));
}

ProcessWatch::~ProcessWatch() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

bool ProcessWatch::gone() const {
  if (fd_ < 0) {
    return !pidRuns(pid_);
  }
  // A pidfd reads as ready once its process has exited (a zombie counts).
  pollfd p{fd_, POLLIN, 0};
  int r;
  do {
    r = ::poll(&p, 1, 0);
  } while (r < 0 && errno == EINTR);
  return r > 0;
}

} // namespace torch_rpc_ext
