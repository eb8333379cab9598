// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/stream/loop.h"

#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "csrc/common/exit_gate.h"
#include "csrc/common/logging.h"
#include "csrc/common/openmp_pool.h"

namespace torch_rpc_ext::transport::stream {

namespace {
[[noreturn]] void fail(const char* what) {
  throw std::runtime_error(std::string(what) + ": " + std::strerror(errno));
}

// Handlers must not throw; if one does anyway, the loop logs it and goes on
// rather than taking the whole process down with std::terminate.
template <typename F>
void runGuarded(F&& fn) {
  // Never start a piece once the process exits (common/exit_gate.h).
  ExitGate::parkIfClosed();
  ExitGate::Busy busy;
  try {
    fn();
  } catch (const std::exception& e) {
    logWarning(std::string("torch_rpc_ext: loop handler threw: ") + e.what());
  } catch (...) {
    logWarning("torch_rpc_ext: loop handler threw a non-exception");
  }
}
} // namespace

// The loop whose runAfterDispatch() work this thread is running, if any.
thread_local const Loop* tlsDeferredOf = nullptr;
// The loop this thread was started for (leader or stalled ex-leader).
thread_local const Loop* tlsThreadOf = nullptr;

// A loop thread's life (loop_threads.cpp starts them): it leads, and when
// it loses the lead it waits as a spare to lead again, or exits. Its name
// says which ("rpcx-shm" leading or finishing a stalled piece,
// "rpcx-shm-spare" parked), as top -H and py-spy show it.
void Loop::runAsLeader(uint64_t generation) {
  tlsThreadOf = this;
  for (;;) {
    nameThisThread(name_);
    if (!run(generation)) {
      return;
    }
    nameThisThread(spareName());
    // Only the thread serving now keeps an OpenMP team (openmp_pool.h).
    releaseOpenMpTeam();
    if (!parkAsSpare(&generation)) {
      retire();
      return;
    }
  }
}

Loop::Loop(
    std::chrono::microseconds busyPoll,
    std::string name,
    bool followCaller)
    : busyPoll_(busyPoll), name_(std::move(name)), followCaller_(followCaller) {
  epollFd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epollFd_ < 0) {
    fail("epoll_create1");
  }
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wakeFd_ < 0) {
    fail("eventfd");
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wakeFd_;
  if (::epoll_ctl(epollFd_, EPOLL_CTL_ADD, wakeFd_, &ev) != 0) {
    fail("epoll_ctl(eventfd)");
  }
  std::lock_guard<std::mutex> lock(threadsMutex_);
  spares_.reserve(kMaxSpares + 1);
  // The first leader: a thread made and promoted at once (generation 0).
  if (!ensureSpareLocked()) {
    throw std::runtime_error("torch_rpc_ext: cannot start a loop thread");
  }
  promoteLocked(0);
  monitor_ = std::thread([this] {
    nameThisThread(name_ + "-mon");
    monitor();
  });
}

Loop::~Loop() {
  stop();
  ::close(wakeFd_);
  ::close(epollFd_);
}

void Loop::addFromLoop(int fd, std::shared_ptr<Pollable> p, uint32_t events) {
  handlers_[fd] = std::move(p);
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  if (::epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    handlers_.erase(fd);
    fail("epoll_ctl(ADD)");
  }
}

void Loop::modify(int fd, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  ::epoll_ctl(epollFd_, EPOLL_CTL_MOD, fd, &ev);
}

void Loop::removeFromLoop(int fd) {
  ::epoll_ctl(epollFd_, EPOLL_CTL_DEL, fd, nullptr);
  handlers_.erase(fd);
  ringFds_.erase(
      std::remove(ringFds_.begin(), ringFds_.end(), fd), ringFds_.end());
}

void Loop::unparkRings() {
  for (int fd : ringFds_) {
    auto it = handlers_.find(fd);
    if (it != handlers_.end()) {
      it->second->unparkRingFromLoop();
    }
  }
}

void Loop::watchRingFromLoop(int fd) {
  if (handlers_.count(fd) != 0 &&
      std::find(ringFds_.begin(), ringFds_.end(), fd) == ringFds_.end()) {
    ringFds_.push_back(fd);
  }
}

int Loop::ringEvents(epoll_event* events, int maxEvents, bool park) {
  int n = 0;
  // From where the last scan stopped: with more busy rings than events,
  // each gets its turn.
  const size_t count = ringFds_.size();
  for (size_t k = 0; k < count; ++k) {
    int fd = ringFds_[(ringScan_ + k) % count];
    if (n == maxEvents) {
      ringScan_ = (ringScan_ + k) % count;
      return n;
    }
    auto it = handlers_.find(fd);
    if (it == handlers_.end()) {
      continue;
    }
    Pollable& p = *it->second;
    if (park ? p.parkRingFromLoop() : p.ringInputFromLoop()) {
      events[n].events = kRingInput;
      events[n].data.fd = fd;
      ++n;
    }
  }
  return n;
}

void Loop::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      return;
    }
    posted_.push_back(std::move(fn));
  }
  if (!inLoop()) { // the leader picks it up before it next waits
    wake();
  }
}

void Loop::runAfter(std::chrono::milliseconds delay, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      return;
    }
    timers_.emplace(std::chrono::steady_clock::now() + delay, std::move(fn));
  }
  if (!inLoop()) { // the leader computes its timeout before it next waits
    wake();
  }
}

void Loop::runAfterDispatch(std::function<void()> fn, bool spinAfter) {
  deferred_.push_back(std::move(fn));
  spinArmed_ = spinArmed_ || spinAfter;
}

namespace {

// Moves the calling thread onto `cpu` (followCaller): its affinity narrowed
// to that CPU, which migrates it there before the call returns, then its
// own mask given back at once, which leaves it there. Nothing runs narrowed
// but the two system calls, so no handler, callback or thread it starts
// inherits one CPU, and the scheduler may move the thread on again (to an
// idle CPU, if the caller computes instead of waiting).
enum class Move {
  kThere, // it already ran there: no system call
  kMoved,
  kNot, // not a CPU it may run on (or none known)
  kStuck, // its own mask could not be given back: it stays on `cpu`
};
Move moveOnto(int cpu, int* error) {
  if (cpu < 0 || cpu >= CPU_SETSIZE) {
    return Move::kNot;
  }
  if (::sched_getcpu() == cpu) {
    return Move::kThere;
  }
  cpu_set_t own;
  if (::pthread_getaffinity_np(::pthread_self(), sizeof(own), &own) != 0 ||
      !CPU_ISSET(cpu, &own)) {
    return Move::kNot;
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  if (::pthread_setaffinity_np(::pthread_self(), sizeof(one), &one) != 0) {
    return Move::kNot;
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    *error = ::pthread_setaffinity_np(::pthread_self(), sizeof(own), &own);
    if (*error == 0) {
      return Move::kMoved;
    }
  }
  return Move::kStuck; // (a cpuset changed under us, or no memory)
}

} // namespace

int Loop::waitForEvents(epoll_event* events, int maxEvents, int timeoutMs) {
  bool spin = spinArmed_ && timeoutMs != 0 && busyPoll_.count() > 0;
  spinArmed_ = false;
  if (spin && spinSkip_ > 0) {
    --spinSkip_;
    spin = false;
  }
  if (!spin && followCaller_.load(std::memory_order_relaxed)) {
    // The response to that lone call is read without a poll: no later,
    // unrelated poll may move to that caller's CPU.
    followPending_.store(false, std::memory_order_relaxed);
  }
  if (spin) {
    // Bounded: at most busyPoll_, then the kernel wait below. A run of polls
    // that find nothing (the peer is not in a ping-pong with us) turns
    // polling off for the next kSkipAfterMisses arms.
    constexpr int kMissesBeforeSkip = 4;
    constexpr int kSkipAfterMisses = 64;
    auto deadline = std::chrono::steady_clock::now() + busyPoll_;
    // Rings are polled in memory every round; the kernel's descriptors
    // every round without rings, and with rings every kEpollEvery-th round
    // (a system call each; counted across waits, so a ring that always has
    // input costs none most of the time and starves no other descriptor).
    do {
      // With followCaller, a caller that sent a lone call (now or during the
      // poll) has the poll move to its CPU.
      if (followCaller_.load(std::memory_order_relaxed) &&
          followPending_.load(std::memory_order_relaxed) &&
          followPending_.exchange(false, std::memory_order_relaxed)) {
        int error = 0;
        Move move =
            moveOnto(callerCpu_.load(std::memory_order_relaxed), &error);
        if (move != Move::kNot) {
          pollsOnCallerCpu_.fetch_add(1, std::memory_order_relaxed);
        }
        if (move == Move::kMoved) {
          pollMoves_.fetch_add(1, std::memory_order_relaxed);
        } else if (move == Move::kStuck) {
          // Never again on this loop: the next move would take this one CPU
          // for the thread's own mask.
          followCaller_.store(false, std::memory_order_relaxed);
          logWarning(
              "torch_rpc_ext: " + name_ +
              ": could not give a transport thread its CPU affinity back "
              "after moving it to a caller's CPU (" +
              std::strerror(error) +
              "); it stays on that CPU, and poll_on_caller_cpu is off for "
              "this transport from now");
        }
      }
      int n = ringEvents(events, maxEvents - 1, /*park=*/false);
      if (ringFds_.empty() || ringRounds_++ % kEpollEvery == 0) {
        int more = ::epoll_wait(epollFd_, events + n, maxEvents - n, 0);
        n += std::max(more, 0);
      }
      if (n != 0) {
        spinMissRun_ = 0;
        spinHits_.fetch_add(1, std::memory_order_relaxed);
        return n;
      }
      // Let a runnable thread have this core: polling must not delay the
      // very work (often our own process's) that produces the next event.
      ::sched_yield();
    } while (std::chrono::steady_clock::now() < deadline);
    spinMisses_.fetch_add(1, std::memory_order_relaxed);
    if (++spinMissRun_ >= kMissesBeforeSkip) {
      spinMissRun_ = 0;
      spinSkip_ = kSkipAfterMisses;
    }
  }
  if (!ringFds_.empty()) {
    // A ring's sender signals only a parked ring; one that has input
    // already is served instead of sleeping.
    // (maxEvents - 1 at most: the kernel's turn comes with them.)
    // Input already waiting is taken without parking first: a parked flag
    // raised even for a moment stops a sender waiting for room from
    // spinning, and it then waits for a signal (a wake-up) instead.
    int n = ringEvents(events, maxEvents - 1, /*park=*/false);
    if (n == 0 && timeoutMs != 0) {
      n = ringEvents(events, maxEvents - 1, /*park=*/true);
    }
    if (n > 0 || timeoutMs == 0) {
      unparkRings();
      if (n > 0) {
        if (ringRounds_++ % kEpollEvery == 0) {
          int more = ::epoll_wait(epollFd_, events + n, maxEvents - n, 0);
          n += std::max(more, 0);
        }
        return n;
      }
    }
  }
  sleeping_.store(true, std::memory_order_seq_cst);
  int n = ::epoll_wait(epollFd_, events, maxEvents, timeoutMs);
  sleeping_.store(false, std::memory_order_relaxed);
  unparkRings();
  return n;
}

void Loop::expectInput() {
  if (followCaller_.load(std::memory_order_relaxed)) {
    callerCpu_.store(::sched_getcpu(), std::memory_order_relaxed);
    followPending_.store(true, std::memory_order_relaxed);
  }
  if (busyPoll_.count() == 0 || !sleeping_.load(std::memory_order_seq_cst)) {
    return;
  }
  if (!pollRequested_.exchange(true)) {
    wake();
  }
}

bool Loop::inLoop() const {
  return tlsDeferredOf != this && leader_.load() == std::this_thread::get_id();
}

void Loop::wake() {
  Io::add(io_.wakes);
  uint64_t one = 1;
  ssize_t rv = ::write(wakeFd_, &one, sizeof(one));
  (void)rv;
}

bool Loop::run(uint64_t generation) {
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  while (true) {
    ExitGate::parkIfClosed();
    int timeoutMs = -1;
    bool stopping = false;
    std::vector<std::function<void()>> work;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto now = std::chrono::steady_clock::now();
      while (!timers_.empty() && timers_.begin()->first <= now) {
        work.push_back(std::move(timers_.begin()->second));
        timers_.erase(timers_.begin());
      }
      if (!timers_.empty()) {
        auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(
            timers_.begin()->first - now);
        timeoutMs = static_cast<int>(wait.count()) + 1;
      }
      work.insert(
          work.end(),
          std::make_move_iterator(posted_.begin()),
          std::make_move_iterator(posted_.end()));
      posted_.clear();
      stopping = stopping_;
    }
    // Deferred work a stalled predecessor left behind runs before we stop.
    if (stopping && work.empty() && deferred_.empty()) {
      break;
    }
    for (auto& fn : work) {
      runGuarded(fn);
    }
    if (!runDeferred(generation)) {
      return true;
    }
    if (!work.empty() || stopping) {
      timeoutMs = 0; // new work may have been posted meanwhile
    }
    int n = waitForEvents(events, kMaxEvents, timeoutMs);
    ExitGate::parkIfClosed();
    if (n < 0 && errno != EINTR) {
      fail("epoll_wait");
    }
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == wakeFd_) {
        uint64_t drain;
        ssize_t rv = ::read(wakeFd_, &drain, sizeof(drain));
        (void)rv;
        if (pollRequested_.exchange(false)) {
          spinArmed_ = true;
        }
        continue;
      }
      auto it = handlers_.find(fd);
      if (it == handlers_.end()) {
        continue;
      }
      auto keep = it->second; // a handler may remove itself
      uint32_t ev = events[i].events;
      runGuarded([&] { keep->handleEventsFromLoop(ev); });
    }
    if (!runDeferred(generation)) {
      return true;
    }
  }
  handlers_.clear();
  runThreadExitHook();
  {
    std::lock_guard<std::mutex> lock(threadsMutex_);
    leaderExited_ = true;
  }
  threadsCv_.notify_all();
  return false;
}

bool Loop::runDeferred(uint64_t generation) {
  const uint64_t idle = generation << 1;
  const uint64_t busy = idle | 1;
  while (!deferred_.empty()) {
    auto fn = std::move(deferred_.front());
    deferred_.pop_front();
    deferredSeq_.fetch_add(1, std::memory_order_relaxed);
    // seq_cst, as the monitor's idle mark and its second look (monitor()):
    // either it sees this piece, or this sees its mark and wakes it.
    state_.store(busy);
    if (monitorIdle_.load() && monitorIdle_.exchange(false)) {
      // Under the mutex, so the monitor cannot miss it between its check
      // and its wait.
      {
        std::lock_guard<std::mutex> lock(threadsMutex_);
      }
      threadsCv_.notify_all();
    }
    tlsDeferredOf = this;
    runGuarded(fn);
    // Its captures go while this thread still counts as not the loop's:
    // the loop may have gone to a new leader meanwhile, which for a moment
    // still reads as this thread (a helper's reading, session 94).
    fn = nullptr;
    tlsDeferredOf = nullptr;
    uint64_t expected = busy;
    if (!state_.compare_exchange_strong(
            expected, idle, std::memory_order_acq_rel)) {
      // The loop went to a new leader while `fn` ran (the monitor, or
      // `fn` making a call: handOff()); what is left in deferred_ is now
      // its work. Leave without touching anything (loop_threads.cpp).
      return false;
    }
  }
  return true;
}

void Loop::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      return;
    }
    stopping_ = true;
    timers_.clear();
  }
  if (ExitGate::closed()) {
    // The process is exiting and our threads are parked for good (or soon
    // will be): nothing to wait for, and nothing may be woken. The owner
    // never frees a loop after this (Agent's deleter leaks it).
    std::lock_guard<std::mutex> lock(threadsMutex_);
    monitor_.detach();
    for (auto& [id, t] : threads_) {
      t.detach();
    }
    threads_.clear();
    return;
  }
  wake();
  if (tlsThreadOf == this) {
    // Called from our own work: we cannot wait for ourselves. The threads
    // finish on their own (as before the loop could hand itself on).
    std::lock_guard<std::mutex> lock(threadsMutex_);
    monitorStop_ = true;
    threadsCv_.notify_all();
    spareCv_.notify_all();
    monitor_.detach();
    for (auto& [id, t] : threads_) {
      t.detach();
    }
    threads_.clear();
    return;
  }
  {
    std::unique_lock<std::mutex> lock(threadsMutex_);
    threadsCv_.wait(lock, [&] { return leaderExited_; });
    monitorStop_ = true;
  }
  threadsCv_.notify_all();
  spareCv_.notify_all(); // spares exit
  monitor_.join();
  ThreadsById all;
  {
    std::lock_guard<std::mutex> lock(threadsMutex_);
    all.swap(threads_);
    exited_.clear();
  }
  // Stalled ex-leaders finish the user work they are in.
  for (auto& [id, t] : all) {
    t.join();
  }
}

} // namespace torch_rpc_ext::transport::stream
