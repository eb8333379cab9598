// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

// Whether another process of this PID namespace still runs.
//
// A peer that shares device memory by legacy handle (cuda_ipc) lives in our
// PID namespace, and after its connection closed the only word of it left
// is whether it lives: a live one may still be copying out of our memory, a
// dead one's copies never complete. The process is held by a pidfd, opened
// while the connection is up, so that a PID reused after the peer's death
// is never taken for it; where pidfds are missing (Linux before 5.3, a
// seccomp filter) the PID alone is asked (kill(), and /proc for a zombie
// not yet reaped), which a reuse can fool into "alive" (memory kept
// longer, never freed early). The PID is the peer's word: an authenticated
// peer that lies about it can make us keep what it could hold anyway by
// living and never completing its copies.

namespace torch_rpc_ext {

class ProcessWatch {
 public:
  // `pid`: decimal, as a peer published it. Null if it names no process
  // (not a number, <= 1, ours, or already gone).
  static std::shared_ptr<const ProcessWatch> open(const std::string& pid);
  ~ProcessWatch();
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  // The process has exited (asked of the kernel, no wait).
  bool gone() const;
  pid_t pid() const {
    return pid_;
  }

 private:
  ProcessWatch(pid_t pid, int fd) : pid_(pid), fd_(fd) {}
  pid_t pid_;
  int fd_; // a pidfd, or -1: the PID alone is asked
};

} // namespace torch_rpc_ext
