// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The agent's client calls: each registered as send() writes it, and
// settled exactly once (by its response, its timeout, its connection's
// loss, or shutdown) on the thread that suits its waiter. Counts the calls
// in flight for join() (as TensorPipe: only client calls are counted, since
// every server call is some worker's client call).
//
// Threads:
//  - nextId(), begin(), add(), write(): senders' threads (and the pool, for
//    a write that fault injection delays);
//  - respond(), connectionLost(): loop threads. A lone call (the rpc_sync
//    pattern) completes there, right after the read pass; others on the
//    completion thread; failures on the agent's pool;
//  - the CallTable's thread expires calls;
//  - drain(), withActiveCount(): the thread in join(); close(), failAll(),
//    stop(): shutdown.
// countMutex_ guards active_ (the table has its own lock). A settled call's
// callbacks never run under a lock of ours.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/rpc/message.h>

#include "csrc/agent/call_table.h"
#include "csrc/agent/membership.h"
#include "csrc/agent/remote_profiling.h"
#include "csrc/common/thread_pool.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext {

class Calls {
 public:
  // `self`: our worker name, for warnings. `pool`: where failures are
  // settled (it outlives us). `onTick`: the table thread's housekeeping.
  Calls(std::string self, ThreadPool& pool, std::function<void()> onTick);

  // The agent that holds us: callbacks queued elsewhere keep it alive while
  // they wait (set once, right after the agent is made).
  void setOwner(std::weak_ptr<void> owner) {
    owner_ = std::move(owner);
  }

  int64_t nextId() {
    return nextId_.fetch_add(1, std::memory_order_relaxed);
  }
  // A call starts (before it can fail): join() waits for it to finish.
  void begin();
  // ...and finishes without being registered (its send() threw).
  void finished();
  // Register a call; returns how many were in flight before it.
  size_t add(int64_t id, CallTable::Call call) {
    return table_.add(id, std::move(call));
  }
  // Write a registered call's frame; fail the call if the connection is
  // gone. A frame the connection refuses (it throws) fails the call too,
  // and the exception goes on to the caller. False if the frame was not
  // queued (the connection was closed already): it reached nobody.
  bool write(
      const std::shared_ptr<transport::Connection>& conn,
      frame::OutboundFrame frame,
      int64_t id,
      Peer& peer);

  // A response arrived on `conn` (`bytes` on the wire), its CUDA tensors
  // ready on `streams`.
  void respond(
      transport::Connection& conn,
      c10::intrusive_ptr<rpc::Message> response,
      std::vector<c10::Stream> streams,
      uint64_t bytes);
  // `conn` closed: fail the calls it carried. `quiet`: shutting down (no
  // warning).
  void connectionLost(
      transport::Connection& conn,
      const std::string& reason,
      bool quiet);

  // join(): wait until no call is in flight (throws at `deadline`, naming
  // `timeout`); run `f` with the count of calls in flight, held so that it
  // does not go stale while `f` runs.
  void drain(
      std::optional<std::chrono::steady_clock::time_point> deadline,
      float timeout);
  template <typename F>
  auto withActiveCount(F f) {
    std::unique_lock<std::mutex> lock(countMutex_);
    return f(active_);
  }

  // Shutdown, in order: close() (failures settle inline from now on: the
  // pool stops), failAll() (as often as calls may still be registered),
  // stop() (the table's thread, the profiling tracks, the completion
  // thread, which completes what it holds).
  void close() {
    closed_ = true;
  }
  void failAll(const std::string& why);
  void stop();

  // agent.client_active_calls, rpc_ext.late_responses,
  // rpc_ext.completions.{retired_futures, retire_batches, held_gil,
  // gil_holds} (get_metrics), and
  // rpc_ext.pending_calls (get_debug_info).
  void addMetrics(std::unordered_map<std::string, std::string>& m);
  size_t pending() const {
    return table_.size();
  }
  std::unordered_map<const Peer*, CallTable::PeerPending> pendingByPeer()
      const {
    return table_.pendingByPeer();
  }
  std::pair<std::vector<CallTable::Pending>, size_t> oldest(
      size_t limit) const {
    return table_.oldest(limit);
  }

 private:
  // Complete a call on `conn`'s loop thread after its read pass, or on the
  // completion thread. `lastInFlight`: no other call is waiting.
  void settle(
      transport::Connection& conn,
      CallTable::Call call,
      c10::intrusive_ptr<rpc::Message> response,
      bool lastInFlight);
  void settleWithError(CallTable::Call call, std::string error);
  // Drop a future the completion thread completed (see calls.cpp: batched
  // under one GIL acquisition).
  void retire(c10::intrusive_ptr<c10::ivalue::Future> future);
  // Complete the calls queued in held_, up to 32, under one acquisition of
  // the GIL (calls.cpp). `owner`: the agent, held while tasks are queued.
  void completeHoldingGil(const std::shared_ptr<void>& owner);
  // Complete a call's future with its response (or the error it carries).
  void complete(
      CallTable::Call& call,
      c10::intrusive_ptr<rpc::Message> response);

  const std::string self_;
  ThreadPool& pool_;
  std::weak_ptr<void> owner_;
  // Completes the futures of calls that were not alone in flight, in order,
  // on one thread; a completion that blocks (a callback waiting on another
  // call) gets another thread after 20 ms, as in the pool.
  ThreadPool completions_;
  std::mutex retiredMutex_;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> retired_;
  uint64_t retiredCount_ = 0; // futures retired, and the batches they went in
  uint64_t retireBatches_ = 0;
  // Completed and dropped in completeHoldingGil() (under heldMutex_); and
  // its acquisitions of the GIL.
  uint64_t heldCount_ = 0;
  std::atomic<uint64_t> gilHolds_{0};
  // Calls to complete holding the GIL (CallTable::Call::completeHoldingGil),
  // in arrival order.
  std::mutex heldMutex_;
  std::deque<std::pair<CallTable::Call, c10::intrusive_ptr<rpc::Message>>>
      held_;
  bool heldTaskQueued_ = false; // a completeHoldingGil() task not yet begun
  size_t heldDrainers_ = 0; // its tasks taking calls off held_
  // Under heldMutex_: whether a call queued in held_ needs a task queued
  // for it (none takes calls off it, none is queued); marks one queued.
  bool heldNeedsTaskLocked();
  // Remote work in the caller's torch.profiler trace.
  RemoteProfiling profiling_;
  CallTable table_;
  std::atomic<int64_t> nextId_{0};
  std::atomic<uint64_t> lateResponses_{0};
  std::atomic<bool> closed_{false};
  std::mutex countMutex_;
  std::condition_variable countCv_;
  int64_t active_ = 0;
};

} // namespace torch_rpc_ext
