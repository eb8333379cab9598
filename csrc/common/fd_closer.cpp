// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/fd_closer.h"

#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "csrc/common/logging.h"
#include "csrc/common/threads.h"

namespace torch_rpc_ext {
namespace {

// A close that took longer than this is logged.
constexpr std::chrono::seconds kSlowClose{1};

// One per process, on the heap and never freed: closers are detached and
// may be inside close() when the process exits. After a fork the child's
// copy names no live thread (and its mutex may be held by one that is
// gone), so a child makes its own (the parent's is left as it is).
struct Closers {
  pid_t pid = ::getpid();
  std::mutex mu;
  std::condition_variable wake;
  std::condition_variable caughtUp; // closed reached handed
  std::deque<int> queue;
  int threads = 0;
  int idle = 0;
  int busy = 0; // closers inside a close
  uint64_t handed = 0;
  uint64_t closed = 0;
  bool handingOver = false; // a hand-over thread is taking the queue
  int handOverThreads = 0; // hand-over threads (a FUSE flush may hold one)
  uint64_t viaChildren = 0; // closed by handing them to a child
  std::vector<pid_t> children; // not yet reaped
  bool warnedNoChild = false;
};

std::atomic<Closers*> gClosers{nullptr};

Closers& closers() {
  Closers* c = gClosers.load(std::memory_order_acquire);
  while (c == nullptr || c->pid != ::getpid()) {
    auto* fresh = new Closers();
    if (gClosers.compare_exchange_strong(c, fresh)) {
      return *fresh;
    }
    delete fresh; // another thread made one first: `c` is now it
  }
  return *c;
}

// (Below: a thread that hands what waits to a child, every closer stuck.)
void startHandOverLocked(Closers& c);

void runCloser(Closers* c) {
  nameThisThread("rpcx-fdclose");
  std::unique_lock<std::mutex> lock(c->mu);
  while (true) {
    ++c->idle;
    c->wake.wait(lock, [c] { return !c->queue.empty(); });
    --c->idle;
    int fd = c->queue.front();
    c->queue.pop_front();
    if (++c->busy >= kMaxClosers && !c->queue.empty()) {
      startHandOverLocked(*c); // this one may be stuck too
    }
    lock.unlock();
    auto start = std::chrono::steady_clock::now();
    ::close(fd);
    auto took = std::chrono::steady_clock::now() - start;
    if (took > kSlowClose) {
      logWarning(
          "torch_rpc_ext: closing a descriptor a peer handed us took " +
          std::to_string(
              std::chrono::duration_cast<std::chrono::milliseconds>(took)
                  .count()) +
          " ms (a lingering socket, or a file whose filesystem the peer "
          "serves); it held a closer thread, not a loop");
    }
    lock.lock();
    --c->busy;
    ++c->closed;
    c->caughtUp.notify_all();
  }
}

// Every closer stuck: the descriptors still waiting go to a child process
// that takes them, after which our closes are not the last ones; the
// child's are, made as it exits, and a socket's close in an exiting task
// does not linger (inet_release skips SO_LINGER for PF_EXITING). (A FUSE
// file's flush comes with every close, ours as well: it holds the
// hand-over thread that closes ours, one of at most kMaxHandOvers, and the
// child's exit.)
//
// The child is a raw clone() of this process, so no at-fork handler
// runs, and it makes system calls only, as a child of a threaded process
// must. It first closes every descriptor it inherited but its socket (its
// copies of ours must not outlive our closes), then takes what we send,
// acknowledging each message, and exits when we close our end (or when we
// exit).
constexpr auto kChildAnswer = std::chrono::seconds(5);
constexpr int kMaxHandOvers = 16;
// How long every closer must have been busy before what waits is handed to
// a child (a fork of this process costs milliseconds; a plain close, less).
constexpr auto kStuckAfter = std::chrono::milliseconds(100);

[[noreturn]] void childTakes(int sock) {
  uint64_t blocked = ~uint64_t(0);
  ::syscall(
      SYS_rt_sigprocmask, SIG_SETMASK, &blocked, nullptr, sizeof(blocked));
  bool closedAll =
      ::syscall(SYS_close_range, static_cast<unsigned>(sock + 1), ~0u, 0u) == 0;
  if (sock > 0) {
    closedAll =
        ::syscall(SYS_close_range, 0u, static_cast<unsigned>(sock - 1), 0u) ==
            0 &&
        closedAll;
  }
  for (int fd = 0; !closedAll && fd < 65536; ++fd) {
    if (fd != sock) {
      ::syscall(SYS_close, fd); // (a kernel before 5.9: no close_range)
    }
  }
  alignas(cmsghdr) char control[CMSG_SPACE(kMaxFdsPerMessage * sizeof(int))];
  while (true) {
    char byte = 0;
    iovec iov{&byte, 1};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    long n = ::syscall(SYS_recvmsg, sock, &msg, 0);
    if (n <= 0) {
      break; // our end closed: what it sent is ours to close, exiting
    }
    ::syscall(SYS_write, sock, &byte, 1);
  }
  ::syscall(SYS_exit_group, 0);
  __builtin_unreachable();
}

void reapChildren(std::vector<pid_t>& children) {
  for (size_t i = 0; i < children.size();) {
    int status = 0;
    pid_t r = ::waitpid(children[i], &status, WNOHANG | __WALL);
    if (r == 0) {
      ++i;
    } else {
      children[i] = children.back(); // gone (or reaped by someone else)
      children.pop_back();
    }
  }
}

// Hands `fds` to a new child and closes ours; false (nothing closed) if no
// child took them, with `why`.
bool closeThroughChild(
    const std::vector<int>& fds,
    pid_t& child,
    std::string& why) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    why = std::string("socketpair: ") + std::strerror(errno);
    return false;
  }
  // Exit signal 0: no SIGCHLD for a handler of the user's, and a wait()
  // for any child without __WALL does not take it.
  long pid = ::syscall(SYS_clone, 0, nullptr, nullptr, nullptr, nullptr);
  if (pid == 0) {
    childTakes(sv[1]);
  }
  ::close(sv[1]);
  if (pid < 0) {
    why = std::string("clone: ") + std::strerror(errno);
    ::close(sv[0]);
    return false;
  }
  child = static_cast<pid_t>(pid);
  bool taken = true;
  for (size_t at = 0; taken && at < fds.size(); at += kMaxFdsPerMessage) {
    size_t n = std::min(kMaxFdsPerMessage, fds.size() - at);
    alignas(cmsghdr) char control[CMSG_SPACE(kMaxFdsPerMessage * sizeof(int))];
    char byte = 1;
    iovec iov{&byte, 1};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(n * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(n * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.data() + at, n * sizeof(int));
    pollfd answer{sv[0], POLLIN, 0};
    taken = ::sendmsg(sv[0], &msg, MSG_NOSIGNAL) == 1 &&
        ::poll(&answer, 1, static_cast<int>(kChildAnswer.count() * 1000)) ==
            1 &&
        ::read(sv[0], &byte, 1) == 1;
  }
  if (!taken) {
    why = "the child did not take them";
    ::kill(child, SIGKILL);
    ::close(sv[0]);
    return false;
  }
  for (int fd : fds) {
    ::close(fd); // the child holds each: not the last close
  }
  ::close(sv[0]); // the child exits
  return true;
}

void runHandOver(Closers* c) {
  nameThisThread("rpcx-fdhand");
  // Every closer is inside a close: stuck, unless one returns soon (a
  // burst of plain closes) and takes what waits itself.
  std::this_thread::sleep_for(kStuckAfter);
  std::unique_lock<std::mutex> lock(c->mu);
  if (c->queue.empty() || c->busy < kMaxClosers) {
    c->handingOver = false;
    --c->handOverThreads;
    return;
  }
  std::vector<int> fds(c->queue.begin(), c->queue.end());
  c->queue.clear();
  reapChildren(c->children);
  lock.unlock();
  pid_t child = -1;
  std::string why;
  const bool ok = closeThroughChild(fds, child, why);
  lock.lock();
  if (child > 0) {
    c->children.push_back(child);
  }
  c->handingOver = false;
  if (!ok) {
    // Back to the queue, for the next closer that returns.
    c->queue.insert(c->queue.begin(), fds.begin(), fds.end());
    --c->handOverThreads;
    if (!c->warnedNoChild) {
      c->warnedNoChild = true;
      logWarning(
          "torch_rpc_ext: every descriptor closer is stuck and " +
          std::to_string(fds.size()) +
          " descriptors a peer handed us could not go to a child process (" +
          why + "); they wait, open, for a closer");
    }
  } else if (!c->queue.empty() && c->idle == 0) {
    startHandOverLocked(*c); // more came meanwhile
  }
  lock.unlock();
  if (!ok) {
    return;
  }
  // Ours are not the last: a socket's returns at once. A FUSE file's
  // flush comes with every close, the last or not, and can hold this
  // thread (one of at most kMaxHandOvers; the role of taker has passed on).
  for (int fd : fds) {
    ::close(fd);
  }
  lock.lock();
  c->closed += fds.size();
  c->viaChildren += fds.size();
  --c->handOverThreads;
  c->caughtUp.notify_all();
}

void startHandOverLocked(Closers& c) {
  if (c.handingOver || c.handOverThreads >= kMaxHandOvers) {
    return;
  }
  try {
    std::thread(runHandOver, &c).detach();
    c.handingOver = true;
    ++c.handOverThreads;
  } catch (const std::system_error&) {
    // (No thread: they wait for a closer.)
  }
}

} // namespace

void closeOffThread(int fd) {
  if (fd < 0) {
    return;
  }
  Closers& c = closers();
  std::unique_lock<std::mutex> lock(c.mu);
  c.queue.push_back(fd);
  ++c.handed;
  // Idle closers (woken ones included: they count as idle until they take
  // from the queue) for all that waits, or as many closers as may be.
  if (c.queue.size() <= static_cast<size_t>(c.idle)) {
    c.wake.notify_one();
    return;
  }
  if (c.threads >= kMaxClosers) {
    c.wake.notify_one();
    if (c.busy >= kMaxClosers) {
      // Every closer is inside a close: what waits goes to a child.
      startHandOverLocked(c);
    }
    return;
  }
  // More waits than idle closers take (every closer may be stuck): one
  // more.
  try {
    std::thread(runCloser, &c).detach();
    ++c.threads;
    return;
  } catch (const std::system_error& e) {
    logWarning(
        std::string("torch_rpc_ext: could not start a descriptor closer: ") +
        e.what());
  }
  if (c.threads > 0) {
    c.wake.notify_one();
    return;
  }
  // No thread to be had at all: close here rather than keep it open.
  c.queue.pop_back();
  lock.unlock();
  ::close(fd);
  lock.lock();
  ++c.closed;
  c.caughtUp.notify_all();
}

void closeSocket(int fd) {
  if (fd < 0) {
    return;
  }
  int domain = 0;
  socklen_t len = sizeof(domain);
  int queued = 0;
  if (::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 &&
      domain == AF_UNIX) {
    ::shutdown(fd, SHUT_RDWR);
    if (::ioctl(fd, FIONREAD, &queued) != 0) {
      queued = 1; // unknown: as if something were there
    }
  }
  if (queued > 0) {
    closeOffThread(fd);
  } else {
    ::close(fd);
  }
}

void closeOffThread(std::vector<int>& fds) {
  for (int fd : fds) {
    closeOffThread(fd);
  }
  fds.clear();
}

void collectPassedFds(const msghdr& msg, std::vector<int>& into) {
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
       c = CMSG_NXTHDR(const_cast<msghdr*>(&msg), c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < n; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        into.push_back(fd);
      }
    }
  }
}

bool waitForFdClosers(std::chrono::milliseconds timeout) {
  Closers& c = closers();
  std::unique_lock<std::mutex> lock(c.mu);
  const uint64_t target = c.handed;
  return c.caughtUp.wait_for(
      lock, timeout, [&c, target] { return c.closed >= target; });
}

FdCloserStats fdCloserStats() {
  Closers& c = closers();
  std::lock_guard<std::mutex> lock(c.mu);
  reapChildren(c.children);
  FdCloserStats s;
  s.closed = c.closed;
  s.pending = c.handed - c.closed;
  s.viaChildren = c.viaChildren;
  s.children = c.children.size();
  return s;
}

} // namespace torch_rpc_ext
