// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/fd_closer.h"

#include <sys/ioctl.h>
#include <sys/socket.h>
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
  uint64_t handed = 0;
  uint64_t closed = 0;
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

void runCloser(Closers* c) {
  nameThisThread("rpcx-fdclose");
  std::unique_lock<std::mutex> lock(c->mu);
  while (true) {
    ++c->idle;
    c->wake.wait(lock, [c] { return !c->queue.empty(); });
    --c->idle;
    int fd = c->queue.front();
    c->queue.pop_front();
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
    ++c->closed;
    c->caughtUp.notify_all();
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
  if (c.queue.size() <= static_cast<size_t>(c.idle) ||
      c.threads >= kMaxClosers) {
    c.wake.notify_one();
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
  FdCloserStats s;
  s.closed = c.closed;
  s.pending = c.handed - c.closed;
  return s;
}

} // namespace torch_rpc_ext
