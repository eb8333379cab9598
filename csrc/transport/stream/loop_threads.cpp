// SPDX-License-Identifier: BSD-3-Clause
// The loop's threads (loop.h): the leader, its successors when a piece of
// deferred work stalls it or hands the loop on, and the monitor that
// watches for stalls.
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "csrc/common/exit_gate.h"
#include "csrc/common/logging.h"
#include "csrc/common/threads.h"
#include "csrc/transport/connection.h"
#include "csrc/transport/stream/loop.h"

namespace torch_rpc_ext::transport::stream {

// loop.cpp's: the loop whose runAfterDispatch() work this thread runs.
extern thread_local const Loop* tlsDeferredOf;

void Loop::spawnLeaderLocked(uint64_t generation) {
  // A spare (an ex-leader whose piece has finished) leads at once: a
  // wake-up, not a thread's creation.
  if (!spares_.empty()) {
    promotedId_ = spares_.back();
    promotedGeneration_ = generation;
    spares_.pop_back();
    leader_.store(promotedId_);
    spareCv_.notify_all();
    return;
  }
  std::thread t([this, generation] {
    nameThisThread(name_);
    ThreadHooksScope hooks;
    runAsLeader(generation);
  });
  leader_.store(t.get_id());
  threads_.emplace(t.get_id(), std::move(t));
}

bool Loop::parkAsSpare(uint64_t* generation) {
  const auto me = std::this_thread::get_id();
  std::unique_lock<std::mutex> lock(threadsMutex_);
  if (monitorStop_ || spares_.size() >= kMaxSpares) {
    return false;
  }
  spares_.push_back(me);
  spareCv_.wait_for(lock, kSpareIdle, [&] {
    return promotedId_ == me || monitorStop_;
  });
  if (promotedId_ == me) {
    promotedId_ = std::thread::id();
    *generation = promotedGeneration_;
    return true;
  }
  spares_.erase(std::remove(spares_.begin(), spares_.end(), me), spares_.end());
  return false;
}

void Loop::handOffIfServing() {
  if (tlsDeferredOf != nullptr) {
    const_cast<Loop*>(tlsDeferredOf)->handOff();
  }
}

void Loop::handOff() {
  std::lock_guard<std::mutex> lock(threadsMutex_);
  uint64_t s = state_.load(std::memory_order_acquire);
  // Our own piece still holds the lead (the monitor may have taken it).
  if ((s & 1) == 0 || leader_.load() != std::this_thread::get_id() ||
      threads_.size() >= kMaxThreads) {
    return;
  }
  if (state_.compare_exchange_strong(
          s, (s & ~uint64_t(1)) + 2, std::memory_order_acq_rel)) {
    handOffs_.fetch_add(1, std::memory_order_relaxed);
    spawnLeaderLocked((s >> 1) + 1);
  }
}

void Loop::monitor() {
  using Clock = std::chrono::steady_clock;
  constexpr auto kTick = std::chrono::milliseconds(1);
  constexpr int kQuietTicksBeforeSleep = 1000;
  uint64_t watchedSeq = ~uint64_t(0);
  Clock::time_point watchedSince;
  uint64_t lastSeq = ~uint64_t(0);
  int quietTicks = 0;
  bool warnedAtCap = false;
  std::unique_lock<std::mutex> lock(threadsMutex_);
  while (!monitorStop_) {
    reapLocked();
    if (quietTicks >= kQuietTicksBeforeSleep) {
      // Nothing deferred for a second: sleep until the leader starts some.
      monitorIdle_.store(true);
      threadsCv_.wait(
          lock, [&] { return monitorStop_ || !monitorIdle_.load(); });
      quietTicks = 0;
      watchedSeq = ~uint64_t(0);
      continue;
    }
    threadsCv_.wait_for(lock, kTick);
    if (ExitGate::closed()) {
      lock.unlock();
      ExitGate::parkIfClosed();
    }
    if (monitorStop_) {
      break;
    }
    uint64_t s = state_.load(std::memory_order_acquire);
    uint64_t seq = deferredSeq_.load(std::memory_order_relaxed);
    quietTicks = seq == lastSeq && (s & 1) == 0 ? quietTicks + 1 : 0;
    lastSeq = seq;
    if ((s & 1) == 0) {
      watchedSeq = ~uint64_t(0);
      continue;
    }
    auto now = Clock::now();
    if (seq != watchedSeq) {
      watchedSeq = seq;
      watchedSince = now;
      continue;
    }
    if (now - watchedSince < kTakeoverAfter) {
      continue;
    }
    // The same piece has run for kTakeoverAfter: promote a fresh leader,
    // unless stalled pieces already hold kMaxThreads threads (then the loop
    // waits for one of them, as a pool of that size would).
    if (threads_.size() >= kMaxThreads) {
      if (!warnedAtCap) {
        warnedAtCap = true;
        logWarning(
            "torch_rpc_ext: " + std::to_string(threads_.size()) +
            " transport threads are blocked in requests; not adding more");
      }
      continue;
    }
    uint64_t expected = s;
    if (state_.compare_exchange_strong(
            expected, (s & ~uint64_t(1)) + 2, std::memory_order_acq_rel)) {
      takeovers_.fetch_add(1, std::memory_order_relaxed);
      spawnLeaderLocked((s >> 1) + 1);
    }
    watchedSeq = ~uint64_t(0);
  }
}

void Loop::reapLocked() {
  reapFinished(threads_, exited_);
}

} // namespace torch_rpc_ext::transport::stream

namespace torch_rpc_ext::transport {

void handOffServingLoop() {
  stream::Loop::handOffIfServing();
}

} // namespace torch_rpc_ext::transport
