// SPDX-License-Identifier: BSD-3-Clause
// The loop's threads (loop.h): the leader, its successors when a piece of
// deferred work stalls it or hands the loop on, and the monitor that
// watches for stalls.
#include <algorithm>
#include <chrono>
#include <string>
#include <system_error>
#include <thread>

#include "csrc/common/exit_gate.h"
#include "csrc/common/logging.h"
#include "csrc/common/threads.h"
#include "csrc/transport/connection.h"
#include "csrc/transport/stream/loop.h"

namespace torch_rpc_ext::transport::stream {

// loop.cpp's: the loop whose runAfterDispatch() work this thread runs.
extern thread_local const Loop* tlsDeferredOf;

bool Loop::ensureSpareLocked() {
  if (!spares_.empty()) {
    return true;
  }
  if (monitorStop_ || threads_.size() >= kMaxThreads) {
    return false;
  }
  // Made before any state changes: a thread that cannot be had (the
  // process's limit, memory) leaves the loop with its leader.
  std::thread t;
  try {
    t = std::thread([this] {
      nameThisThread(spareName());
      ThreadHooksScope hooks;
      uint64_t generation = 0;
      std::unique_lock<std::mutex> lock(threadsMutex_);
      if (awaitPromotionLocked(lock, &generation)) {
        lock.unlock();
        runAsLeader(generation);
      } else {
        lock.unlock();
        retire();
      }
    });
  } catch (const std::exception& e) {
    if (!warnedNoThread_) {
      warnedNoThread_ = true;
      logWarning(
          std::string("torch_rpc_ext: the ") + name_ +
          " loop cannot start a thread (" + e.what() +
          "); a blocked request keeps it until it ends");
    }
    return false;
  }
  const auto id = t.get_id();
  try {
    threads_.emplace(id, std::move(t));
    spares_.push_back(id);
  } catch (const std::exception&) {
    // Out of memory for the bookkeeping: the thread waits its kSpareIdle
    // unpromoted and retires; nothing joins it.
    if (t.joinable()) {
      t.detach();
    } else {
      threads_.at(id).detach();
      threads_.erase(id);
    }
    return false;
  }
  return true;
}

bool Loop::takeLeadLocked(uint64_t s, std::atomic<uint64_t>& counter) {
  // One promotion at a time: the next needs the promoted thread's own
  // piece to be busy, which it can be only after it woke and took the
  // slot.
  if (promotedId_ != std::thread::id() || !ensureSpareLocked()) {
    return false;
  }
  uint64_t expected = s;
  if (!state_.compare_exchange_strong(
          expected, (s & ~uint64_t(1)) + 2, std::memory_order_acq_rel)) {
    return false; // the piece ended meanwhile: nothing to hand on
  }
  counter.fetch_add(1, std::memory_order_relaxed);
  promoteLocked((s >> 1) + 1);
  return true;
}

void Loop::promoteLocked(uint64_t generation) {
  promotedId_ = spares_.back();
  promotedGeneration_ = generation;
  spares_.pop_back();
  leader_.store(promotedId_);
  spareCv_.notify_all();
}

bool Loop::awaitPromotionLocked(
    std::unique_lock<std::mutex>& lock,
    uint64_t* generation) {
  const auto me = std::this_thread::get_id();
  spareCv_.wait_for(
      lock, kSpareIdle, [&] { return promotedId_ == me || monitorStop_; });
  if (promotedId_ == me) {
    promotedId_ = std::thread::id();
    *generation = promotedGeneration_;
    return true;
  }
  spares_.erase(std::remove(spares_.begin(), spares_.end(), me), spares_.end());
  return false;
}

bool Loop::parkAsSpare(uint64_t* generation) {
  std::unique_lock<std::mutex> lock(threadsMutex_);
  if (monitorStop_ || spares_.size() >= kMaxSpares) {
    return false;
  }
  spares_.push_back(std::this_thread::get_id());
  return awaitPromotionLocked(lock, generation);
}

void Loop::retire() {
  // Never past the exit gate; the hook first (it may wait for the GIL), so
  // joining us is prompt.
  ExitGate::parkIfClosed();
  runThreadExitHook();
  std::lock_guard<std::mutex> lock(threadsMutex_);
  exited_.push_back(std::this_thread::get_id());
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
  if (monitorStop_ || (s & 1) == 0 ||
      leader_.load() != std::this_thread::get_id()) {
    return;
  }
  // Nothing else queued for the loop (we lead it, so deferred_ is ours to
  // read): the response this call waits for is likely the loop's next
  // input, so the loop goes now (to a spare, or a thread made for it).
  if (deferred_.empty() && takeLeadLocked(s, handOffs_)) {
    return;
  }
  // Other requests queued (a burst): the monitor looks again in kSoon and
  // hands the loop on only if this piece still runs then, i.e. waits for
  // its call. One that sent and returns (an rpc_async not waited for,
  // torch's RRef messages) keeps the loop: handing it on at every such
  // piece cost a burst of them half its rate (133 -> 259-282 us a call).
  // The monitor is woken only where no such look is pending already (it
  // then finds this piece, the latest, when it looks).
  const bool pending = soonSeq_ != kNoPiece;
  soonSeq_ = deferredSeq_.load(std::memory_order_relaxed);
  soonSince_ = std::chrono::steady_clock::now();
  if (!pending) {
    monitorIdle_.store(false); // an idle monitor's wait ends only so
    threadsCv_.notify_all();
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
      // Looked at again once idle is marked (both seq_cst, as runDeferred's
      // busy mark and its read of monitorIdle_): a piece that began in
      // between either sees the mark and wakes us, or is seen here.
      monitorIdle_.store(true);
      if ((state_.load() & 1) != 0 || deferredSeq_.load() != lastSeq) {
        monitorIdle_.store(false);
        quietTicks = 0;
        continue;
      }
      threadsCv_.wait(
          lock, [&] { return monitorStop_ || !monitorIdle_.load(); });
      quietTicks = 0;
      watchedSeq = ~uint64_t(0);
      continue;
    }
    if (soonSeq_ != kNoPiece) {
      threadsCv_.wait_until(lock, soonSince_ + kSoon);
    } else {
      threadsCv_.wait_for(lock, kTick);
    }
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
      soonSeq_ = kNoPiece; // the piece that made a call ended
      continue;
    }
    auto now = Clock::now();
    if (soonSeq_ != kNoPiece) {
      // A piece that made a call (handOff()).
      if (soonSeq_ != seq) {
        soonSeq_ = kNoPiece; // it ended
      } else if (now - soonSince_ >= kSoon) {
        soonSeq_ = kNoPiece;
        takeLeadLocked(s, handOffs_);
        watchedSeq = ~uint64_t(0);
        continue;
      } else {
        continue;
      }
    }
    if (seq != watchedSeq) {
      watchedSeq = seq;
      watchedSince = now;
      continue;
    }
    if (now - watchedSince < kTakeoverAfter) {
      continue;
    }
    // The same piece has run for kTakeoverAfter: promote a spare or a
    // fresh leader, unless stalled pieces already hold kMaxThreads threads
    // (then the loop waits for one of them, as a pool of that size would).
    if (spares_.empty() && threads_.size() >= kMaxThreads) {
      if (!warnedAtCap) {
        warnedAtCap = true;
        logWarning(
            "torch_rpc_ext: " + std::to_string(threads_.size()) +
            " transport threads are blocked in requests; not adding more");
      }
      continue;
    }
    takeLeadLocked(s, takeovers_);
    watchedSeq = ~uint64_t(0);
  }
}

void Loop::reapLocked() {
  reapFinished(threads_, exited_);
}

} // namespace torch_rpc_ext::transport::stream

namespace torch_rpc_ext::transport {

void handOffServingLoop() {
  try {
    stream::Loop::handOffIfServing();
  } catch (const std::exception& e) {
    // The call is sent already; its loop stays where it is (the monitor
    // still hands it on after 2 ms).
    logWarning(std::string("torch_rpc_ext: loop hand-off failed: ") + e.what());
  }
}

} // namespace torch_rpc_ext::transport
