// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "csrc/common/threads.h"

struct epoll_event;

namespace torch_rpc_ext::transport::stream {

// Something with a file descriptor the loop watches.
class Pollable {
 public:
  virtual ~Pollable() = default;
  // Loop thread: `events` (EPOLLIN, EPOLLOUT, EPOLLERR, EPOLLHUP) are ready.
  virtual void handleEventsFromLoop(uint32_t events) = 0;
  // A source of input besides the descriptor (a frame ring, frame_ring.h),
  // for a Pollable registered with watchRingFromLoop(): input is waiting
  // (checked while the loop polls, with no system call); and before the
  // loop sleeps, ask for a wake-up, true if input is waiting already.
  virtual bool ringInputFromLoop() {
    return false;
  }
  virtual bool parkRingFromLoop() {
    return false;
  }
  virtual void unparkRingFromLoop() {}
};

// In the events handed to a Pollable: its ring has input (no epoll bit).
constexpr uint32_t kRingInput = 1u << 27;

// One epoll thread that owns readiness dispatch, deferred work and timers.
// Handlers run on this thread one at a time; they must not block.
//
// Work handed over with runAfterDispatch() runs on the loop thread too, after
// the handlers of the current round, so a request or a completion costs no
// thread hop. That work may block (a Python UDF waiting for the GIL, a nested
// rpc_sync): a monitor thread watches it, and when one piece runs longer than
// kTakeoverAfter, another thread takes over the loop (leader/follower with
// lazy promotion); a piece that makes a call hands the loop on at once
// (handOffIfServing()). The stalled thread finishes its piece and waits as
// a spare to lead again (kMaxSpares of them), or exits; the loop never
// waits on user code for more than a few milliseconds.
class Loop {
 public:
  // A piece of runAfterDispatch() work older than this hands the loop on.
  static constexpr std::chrono::milliseconds kTakeoverAfter{2};
  // Threads (leader and stalled ex-leaders) one loop may have at once.
  static constexpr size_t kMaxThreads = 4096;

  // `busyPoll`: after serving work deferred with spinAfter, poll for new
  // events this long before sleeping in the kernel (0: never spin).
  // `name`: its threads' (the leader's; "-mon" added, the monitor's).
  // `followCaller`: poll for a lone call's response on the CPU of the thread
  // that sent it (expectInput), see there.
  explicit Loop(
      std::chrono::microseconds busyPoll = std::chrono::microseconds(0),
      std::string name = "rpcx-loop",
      bool followCaller = false);
  ~Loop();

  // Watch `fd` (level-triggered) and keep `p` alive until removeFromLoop().
  // Loop thread only.
  void addFromLoop(int fd, std::shared_ptr<Pollable> p, uint32_t events);
  // Change the watched events of an added fd; safe from any thread.
  void modify(int fd, uint32_t events);
  // Stop watching `fd`. Loop thread only.
  void removeFromLoop(int fd);
  // The handler of `fd` (added) has a ring too: poll it while spinning,
  // park it before sleeping, and hand it kRingInput. Loop thread only;
  // removeFromLoop() ends it.
  void watchRingFromLoop(int fd);

  // Run `fn` on the loop thread, soon. After stop(), `fn` is dropped.
  void post(std::function<void()> fn);
  // Run `fn` on the loop thread after `delay`.
  void runAfter(std::chrono::milliseconds delay, std::function<void()> fn);
  // Loop thread only (from a handler): run `fn` on this thread once the
  // current round of handlers is done. `fn` may block and take the GIL (see
  // above). Unlike post(), it is never dropped: stop() runs what is queued.
  // `spinAfter`: more input is likely soon (a request was served), so poll
  // for up to busyPoll before the next kernel wait (bounded and adaptive:
  // polls that keep finding nothing are skipped for a while).
  void runAfterDispatch(std::function<void()> fn, bool spinAfter = false);

  // Any thread: input is expected soon (a request was just sent). If the
  // loop sleeps in the kernel, wake it now and let it busy-poll (busyPoll),
  // so its wake-up overlaps the peer's work instead of following it.
  //
  // With followCaller, the poll for that input moves to the CPU the
  // calling thread is on, which is about to block until the input comes:
  // the leader's affinity is narrowed to that CPU, which migrates it there,
  // and given back at once (so nothing runs narrowed, and the scheduler may
  // move it on). Where the threads that must run per round trip (the
  // caller, its loop, the peer's loop) outnumber the CPUs, the scheduler
  // otherwise often puts the two loops on one CPU, or the caller beside the
  // peer's loop, and each waits behind the other at every call
  // (docs/performance.md, "The poll on the caller's CPU"). Costs a
  // sched_getcpu per lone call, and three affinity calls per move.
  void expectInput();

  // True on the thread that currently leads the loop, outside
  // runAfterDispatch() work (which must treat itself as any other thread).
  bool inLoop() const;

  // Any thread: if it runs runAfterDispatch() work that still leads its
  // loop (a request being served), that loop goes to another thread (a
  // spare, or one made for it), as the monitor would hand it on after
  // kTakeoverAfter: now if no other work is queued for the loop, else if
  // the piece still runs kSoon later. For a piece about to make a call of
  // its own (a nested rpc_sync): it would wait for a response this very
  // loop may have to read.
  static void handOffIfServing();

  // Busy polls that found an event, and those that ran out.
  uint64_t spinHits() const {
    return spinHits_.load(std::memory_order_relaxed);
  }
  uint64_t spinMisses() const {
    return spinMisses_.load(std::memory_order_relaxed);
  }

  // Polls for a lone call's response run on the caller's CPU (followCaller,
  // expectInput()), and those that had to move there.
  uint64_t pollsOnCallerCpu() const {
    return pollsOnCallerCpu_.load(std::memory_order_relaxed);
  }
  uint64_t pollMoves() const {
    return pollMoves_.load(std::memory_order_relaxed);
  }

  // How often a stalled piece of work handed the loop to a new thread,
  // and how often a piece making a call did (handOffIfServing()).
  uint64_t takeovers() const {
    return takeovers_.load(std::memory_order_relaxed);
  }
  uint64_t handOffs() const {
    return handOffs_.load(std::memory_order_relaxed);
  }

  // What the connections on this loop put through their sockets, counted
  // relaxed (one uncontended add each): what a message costs in frames,
  // system calls and wake-ups (benchmarks/cuda_bench.py --fake reads them).
  struct alignas(64) Io { // its own cache line: written by every sender
    std::atomic<uint64_t> frames{0}; // message frames queued
    std::atomic<uint64_t> controlFrames{0}; // connection and channel frames
    std::atomic<uint64_t> writes{0}; // sendmsg/send calls (TLS: writes)
    // Bytes those calls put in the socket (TLS: plaintext bytes).
    std::atomic<uint64_t> bytesWritten{0};
    std::atomic<uint64_t> reads{0}; // read/recvmsg calls (TLS: reads)
    // Copies into frame rings (frame_ring.h), no system call, and bytes.
    std::atomic<uint64_t> ringWrites{0};
    std::atomic<uint64_t> ringReads{0};
    // Eventfd signals to the other end of a ring (a parked receiver, a
    // sender waiting for room): a system call each.
    std::atomic<uint64_t> ringSignals{0};
    std::atomic<uint64_t> ringBytes{0};
    // Frames through a ring whose large bodies went on the socket beside it.
    std::atomic<uint64_t> ringSocketBodies{0};
    std::atomic<uint64_t> wakes{0}; // the loop woken from another thread
    // Ready connections closed for their peer's silence (heartbeat_timeout).
    std::atomic<uint64_t> heartbeatTimeouts{0};
    // Sockets that ended (reset, hang-up) while their connection held a
    // record for its lanes: read to their end once its stripes landed.
    std::atomic<uint64_t> heldSocketEnds{0};

    static void add(std::atomic<uint64_t>& n) {
      n.fetch_add(1, std::memory_order_relaxed);
    }
  };
  Io& io() {
    return io_;
  }
  const Io& io() const {
    return io_;
  }

  // Run pending work, drop every handler and join the threads. Idempotent.
  void stop();

 private:
  // Leads until stopped (false) or until another thread leads (true).
  bool run(uint64_t generation);
  void runAsLeader(uint64_t generation);
  // An ex-leader waits to lead again (true, with its generation), unless
  // kMaxSpares wait already, none asks within kSpareIdle, or stop().
  bool parkAsSpare(uint64_t* generation);
  // A parked thread's name: "rpcx-shm-spare" for "rpcx-shm".
  std::string spareName() const {
    return name_ + "-spare";
  }
  void handOff();
  // Runs runAfterDispatch() work; false if this thread lost the lead.
  bool runDeferred(uint64_t generation);
  void monitor();
  // Threads (loop_threads.cpp), under threadsMutex_: a spare to promote,
  // made if none waits (false: none can be had); the lead moved from the
  // piece of state `s` to a spare, counted in `counter` (false: the piece
  // ended, or no spare); a spare made leader of `generation`.
  bool ensureSpareLocked();
  bool takeLeadLocked(uint64_t s, std::atomic<uint64_t>& counter);
  void promoteLocked(uint64_t generation);
  // A spare waits for promotion (true, with its generation) or kSpareIdle
  // (false, and it is no spare any more).
  bool awaitPromotionLocked(
      std::unique_lock<std::mutex>& lock,
      uint64_t* generation);
  // A thread that leads no more and waits for nothing: off to be joined.
  void retire();
  void reapLocked();
  void wake();
  // epoll_wait, preceded by a bounded busy poll when one is armed.
  int waitForEvents(epoll_event* events, int maxEvents, int timeoutMs);
  // The rings with input, as kRingInput events (at most maxEvents); with
  // `park`, each is parked first.
  int ringEvents(epoll_event* events, int maxEvents, bool park);
  void unparkRings();

  const std::chrono::microseconds busyPoll_;
  const std::string name_;
  int epollFd_ = -1;
  int wakeFd_ = -1;

  std::mutex mutex_;
  bool stopping_ = false;
  std::vector<std::function<void()>> posted_;
  std::multimap<std::chrono::steady_clock::time_point, std::function<void()>>
      timers_;
  // Leader only.
  std::unordered_map<int, std::shared_ptr<Pollable>> handlers_;
  std::vector<int> ringFds_; // of handlers_ with a ring
  static constexpr unsigned kEpollEvery = 4;
  unsigned ringRounds_ = 0; // polls of the rings, for kEpollEvery
  size_t ringScan_ = 0; // where the next scan of ringFds_ starts
  std::deque<std::function<void()>> deferred_;
  bool spinArmed_ = false;
  int spinMissRun_ = 0; // consecutive busy polls that found nothing
  int spinSkip_ = 0; // armed polls still to skip after a run of misses
  std::atomic<bool> sleeping_{false}; // in the blocking epoll_wait
  std::atomic<bool> pollRequested_{false}; // by expectInput()
  // Turned off (by the loop thread) if a move sticks.
  std::atomic<bool> followCaller_;
  // The CPU of the thread that last called expectInput(), and whether the
  // loop has yet to move its poll there (followCaller).
  std::atomic<int> callerCpu_{-1};
  std::atomic<bool> followPending_{false};
  std::atomic<uint64_t> pollsOnCallerCpu_{0};
  std::atomic<uint64_t> pollMoves_{0};
  std::atomic<uint64_t> spinHits_{0};
  std::atomic<uint64_t> spinMisses_{0};

  // generation << 1 | busy. The leader of generation g sets busy around each
  // piece of deferred work; the monitor takes over by moving busy g to g + 1.
  std::atomic<uint64_t> state_{0};
  std::atomic<uint64_t> deferredSeq_{0}; // pieces started so far
  std::atomic<std::thread::id> leader_;
  std::atomic<uint64_t> takeovers_{0};
  std::atomic<uint64_t> handOffs_{0};
  Io io_;

  // Threads: the current leader, stalled ex-leaders, the monitor.
  std::mutex threadsMutex_;
  std::condition_variable threadsCv_;
  ThreadsById threads_;
  std::vector<std::thread::id> exited_; // to be joined
  bool leaderExited_ = false; // the leader left run() because of stop()
  bool monitorStop_ = false;
  // Ex-leaders waiting to lead again, and the one asked to (spareCv_).
  static constexpr size_t kMaxSpares = 2;
  static constexpr std::chrono::seconds kSpareIdle{10};
  std::condition_variable spareCv_;
  std::vector<std::thread::id> spares_;
  std::thread::id promotedId_;
  uint64_t promotedGeneration_ = 0;
  // A piece that made a call with other work queued (handOff()): the
  // monitor hands the loop on if it still runs kSoon later.
  static constexpr std::chrono::microseconds kSoon{100};
  static constexpr uint64_t kNoPiece = ~uint64_t(0);
  uint64_t soonSeq_ = kNoPiece;
  bool warnedNoThread_ = false;
  std::chrono::steady_clock::time_point soonSince_;
  std::atomic<bool> monitorIdle_{false};
  std::thread monitor_;
};

} // namespace torch_rpc_ext::transport::stream
