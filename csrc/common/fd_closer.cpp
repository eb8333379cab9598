// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/fd_closer.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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
// A child process holding descriptors for their last close (below), and
// the mapping its stack is on.
struct HeldChild {
  pid_t pid = -1;
  void* mapping = nullptr;
  size_t bytes = 0;
};

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
  uint64_t closerReturns = 0; // closes a closer made that returned
  bool handingOver = false; // a hand-over thread is taking the queue
  int handOverThreads = 0; // hand-over threads (a FUSE flush may hold one)
  uint64_t viaChildren = 0; // closed by handing them to a child
  std::vector<HeldChild> children; // not yet reaped
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
    ++c->closerReturns;
    ++c->closed;
    c->caughtUp.notify_all();
  }
}

// Every closer stuck: the descriptors still waiting go to a child process
// that keeps its inherited copies of them, after which our closes are not
// the last ones; the child's are, made as it exits, and a socket's close in
// an exiting task does not linger (inet_release skips SO_LINGER for
// PF_EXITING). (A FUSE file's flush comes with every close, ours and the
// child's exit's alike: it holds the hand-over thread that closes ours,
// one of at most kMaxHandOvers, and the child.)
//
// The child shares our memory (CLONE_VM: nothing is copied, so a child a
// flush holds pins no snapshot of ours) and runs on a stack of its own,
// mapped here with what it needs and unmapped once it is reaped; it gets a
// copy of our descriptor table. Made with every signal blocked, no at-fork
// handler runs, and it makes system calls only. It closes every other
// descriptor it inherited (its copies of ours must not outlive our
// closes), then waits for our end of a socket pair to close, which we do
// once ours are closed, and exits.
constexpr int kMaxHandOvers = 16;
// Not under a sanitizer: TSan's clone interceptor treats a clone as a fork
// and would reset, in the child, state the parent shares; ASan would leave
// the child's stack poisoned. There, what waits waits for a closer.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool kHandOver = false;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
constexpr bool kHandOver = false;
#else
constexpr bool kHandOver = true;
#endif
#else
constexpr bool kHandOver = true;
#endif
// How long no closer may have returned, all of them inside a close,
// before what waits is handed to a child (a plain close takes far less).
constexpr auto kStuckAfter = std::chrono::milliseconds(100);
constexpr size_t kChildStack = 64 << 10;

#ifndef SYS_close_range
#define SYS_close_range 436 // (the generic table's number; alpha aside)
#endif

// What the child reads, at the start of its mapping; `keep` sorted, `sock`
// among them; `limit` above every descriptor.
struct ChildPlan {
  int sock;
  int limit;
  size_t n;
  int keep[1]; // n of them
};

int childKeeps(void* arg) {
  const auto* plan = static_cast<const ChildPlan*>(arg);
  int from = 0;
  for (size_t i = 0; i <= plan->n; ++i) {
    const bool last = i == plan->n;
    int upto = last ? plan->limit - 1 : plan->keep[i] - 1; // [from, upto]
    if (from <= upto &&
        ::syscall(
            SYS_close_range,
            static_cast<unsigned>(from),
            last ? ~0u : static_cast<unsigned>(upto),
            0u) != 0) {
      for (int fd = from; fd <= upto; ++fd) {
        ::syscall(SYS_close, fd); // (no close_range: before Linux 5.9)
      }
    }
    if (!last) {
      from = plan->keep[i] + 1;
    }
  }
  char byte;
  while (::syscall(SYS_read, plan->sock, &byte, 1) > 0) {
    // (Nothing is ever sent: this ends at our close, or ours dying. EINTR
    // cannot come, every signal blocked.)
  }
  ::syscall(SYS_exit_group, 0);
  return 0;
}

// Reaps the children that are gone and unmaps their stacks.
void reapChildren(std::vector<HeldChild>& children) {
  for (size_t i = 0; i < children.size();) {
    int status = 0;
    pid_t r = ::waitpid(children[i].pid, &status, WNOHANG | __WALL);
    if (r == 0) {
      ++i;
      continue;
    }
    // Gone (or, ECHILD, reaped by someone else: gone too).
    ::munmap(children[i].mapping, children[i].bytes);
    children[i] = children.back();
    children.pop_back();
  }
}

// A child that holds a copy of each of `fds` until `release` (returned
// open) is closed; pid -1 and `why` if none could be made.
HeldChild childHolding(
    const std::vector<int>& fds,
    int& release,
    std::string& why) {
  HeldChild child;
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    why = std::string("socketpair: ") + std::strerror(errno);
    return child;
  }
  std::vector<int> keep(fds);
  keep.push_back(sv[1]);
  std::sort(keep.begin(), keep.end());
  const size_t planBytes =
      (sizeof(ChildPlan) + keep.size() * sizeof(int) + 4095) & ~size_t(4095);
  void* mapping = ::mmap(
      nullptr,
      planBytes + kChildStack,
      PROT_READ | PROT_WRITE,
      MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK,
      -1,
      0);
  if (mapping == MAP_FAILED) {
    why = std::string("mmap: ") + std::strerror(errno);
    ::close(sv[0]);
    ::close(sv[1]);
    return child;
  }
  auto* plan = static_cast<ChildPlan*>(mapping);
  plan->sock = sv[1];
  rlimit files{};
  plan->limit = ::getrlimit(RLIMIT_NOFILE, &files) == 0 &&
          files.rlim_cur != RLIM_INFINITY && files.rlim_cur < (1u << 30)
      ? static_cast<int>(files.rlim_cur)
      : (1 << 20);
  plan->limit = std::max(plan->limit, keep.back() + 1);
  plan->n = keep.size();
  std::memcpy(plan->keep, keep.data(), keep.size() * sizeof(int));
  // Every signal blocked across the clone: the child starts with them
  // blocked (no handler of the user's runs in it), we get ours back after.
  sigset_t all;
  sigset_t before;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &before);
  // Exit signal 0: no SIGCHLD for a handler of the user's, and a wait()
  // for any child without __WALL does not take it.
  char* top = static_cast<char*>(mapping) + planBytes + kChildStack;
  int pid = ::clone(childKeeps, top, CLONE_VM, plan);
  int err = errno;
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  ::close(sv[1]);
  if (pid < 0) {
    why = std::string("clone: ") + std::strerror(err);
    ::close(sv[0]);
    ::munmap(mapping, planBytes + kChildStack);
    return child;
  }
  release = sv[0];
  child.pid = pid;
  child.mapping = mapping;
  child.bytes = planBytes + kChildStack;
  return child;
}

bool isSocket(int fd) {
  int type = 0;
  socklen_t len = sizeof(type);
  return ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0;
}

void runHandOver(Closers* c) {
  nameThisThread("rpcx-fdhand");
  std::unique_lock<std::mutex> lock(c->mu);
  // Every closer is inside a close: stuck, unless one returns soon (a
  // burst of plain closes) and then takes what waits itself.
  const uint64_t returnsBefore = c->closerReturns;
  lock.unlock();
  std::this_thread::sleep_for(kStuckAfter);
  lock.lock();
  if (c->queue.empty() || c->busy < kMaxClosers ||
      c->closerReturns != returnsBefore) {
    c->handingOver = false;
    --c->handOverThreads;
    if (!c->queue.empty() && c->busy >= kMaxClosers) {
      startHandOverLocked(*c); // a close returned, but all are busy again
    }
    return;
  }
  std::vector<int> fds(c->queue.begin(), c->queue.end());
  c->queue.clear();
  reapChildren(c->children);
  lock.unlock();
  int release = -1;
  std::string why;
  const HeldChild child = childHolding(fds, release, why);
  lock.lock();
  c->handingOver = false;
  if (child.pid < 0) {
    // Back to the queue, for the next closer that returns (or the next
    // descriptor handed over, which tries again).
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
    return;
  }
  c->children.push_back(child);
  if (!c->queue.empty() && c->busy >= kMaxClosers) {
    startHandOverLocked(*c); // more came meanwhile
  }
  lock.unlock();
  // The child holds a copy of each: ours are not the last, and a socket's
  // returns at once. Sockets first: a FUSE file's flush comes with every
  // close and can hold this thread (the role of taker has passed on).
  std::stable_partition(fds.begin(), fds.end(), isSocket);
  for (int fd : fds) {
    ::close(fd);
  }
  ::close(release); // the child exits, making the last closes
  // This thread lives until the child is gone: the child runs on its TLS
  // (errno, the stack canary), and a child whose exit a FUSE flush holds
  // holds a hand-over thread too, so there are at most kMaxHandOvers.
  // (WNOWAIT: reaped under the lock, its pid ours till then.)
  siginfo_t info{};
  while (::waitid(P_PID, child.pid, &info, WEXITED | WNOWAIT | __WALL) != 0 &&
         errno == EINTR) {
  }
  lock.lock();
  reapChildren(c->children);
  c->closed += fds.size();
  c->viaChildren += fds.size();
  --c->handOverThreads;
  c->caughtUp.notify_all();
  if (!c->queue.empty() && c->busy >= kMaxClosers) {
    startHandOverLocked(*c); // (one that could not start while we ran)
  }
}

void startHandOverLocked(Closers& c) {
  if (!kHandOver || c.handingOver || c.handOverThreads >= kMaxHandOvers) {
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
  s.handOver = kHandOver;
  return s;
}

} // namespace torch_rpc_ext
