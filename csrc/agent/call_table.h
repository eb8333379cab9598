// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include "csrc/agent/latency.h"
#include "csrc/agent/remote_profiling.h"

namespace torch_rpc_ext {

struct Peer; // membership.h

using JitFuture = c10::ivalue::Future;

// The client calls in flight: id -> future, the connection it went out on,
// and its deadline. Exactly one of response, timeout, connection failure or
// shutdown removes an entry, so a future is settled once.
//
// Threads: add() runs on senders' threads; take() on loop threads as
// responses arrive; takeConnection() on the loop thread reporting a close;
// takeAll() and stop() at shutdown. The table's own thread wakes at the
// earliest deadline and hands expired entries to the timeout callback
// outside the lock. mutex_ guards calls_, deadlines_, wakeAt_, stopping_.
class CallTable {
 public:
  struct Call {
    c10::intrusive_ptr<JitFuture> future;
    const void* connection; // identity only, never dereferenced
    // The callee (membership.h: peers live as long as the agent).
    Peer* peer;
    // 0: never expires; below 0 (a caller's, other than torch's "unset"):
    // expired already, as TensorPipe takes it.
    std::chrono::milliseconds timeout;
    std::chrono::steady_clock::time_point deadline;
    // No other call was in flight when this one was registered (set by
    // add()): the rpc_sync pattern.
    bool sentAlone = false;
    // Set while torch.profiler profiles the caller (remote_profiling.h).
    std::shared_ptr<CallProfile> profile;
    // The streams the response's CUDA tensors arrived on (set with the
    // response): the future completes under them.
    std::vector<c10::Stream> arrival;
    // When the request was sent, and what it is (the round trip goes into
    // the peer's CallCosts; the age of a call in flight, oldest()).
    std::chrono::steady_clock::time_point sentAt{};
    CallKind kind = CallKind::kOther;
    // A builtin or TorchScript call (kScript) sent by a user's Python
    // thread (torch's Python frontend): its future's callbacks convert the
    // response under the GIL (toPyJitFuture), then run the user's. Not
    // one sent by a thread of ours (a served UDF, a callback): its future
    // may be the one an @async_execution UDF returns, whose continuation
    // serializes the UDF's result through PythonRpcHandler::getInstance(),
    // which asserts the GIL is free (as a Python UDF's response, kPython,
    // reaches it too). Calls::completeHoldingGil().
    bool completeHoldingGil = false;
  };
  using ExpireFn = std::function<void(int64_t id, Call call)>;

  // `onTick` runs on the table's thread about once a second, for
  // housekeeping that must happen even when no call is in flight.
  CallTable(ExpireFn onExpired, std::function<void()> onTick);
  ~CallTable();

  // Returns how many calls were in flight before this one.
  size_t add(int64_t id, Call call);
  // Remove and return the call, if it is still pending; `remaining`, if
  // given, gets how many calls are left in flight after it.
  std::optional<Call> take(int64_t id, size_t* remaining = nullptr);
  // Remove and return every call sent on `connection`.
  std::vector<std::pair<int64_t, Call>> takeConnection(const void* connection);
  // Remove and return every call.
  std::vector<std::pair<int64_t, Call>> takeAll();
  size_t size() const;
  // Per callee: how many calls are in flight and when the oldest was sent
  // (get_metrics' rpc_ext.peer.<name>.in_flight and .oldest_call_ms): a
  // walk of the table under its lock, for a scrape, not a hot path.
  struct PeerPending {
    size_t count = 0;
    std::chrono::steady_clock::time_point oldest =
        std::chrono::steady_clock::time_point::max();
  };
  std::unordered_map<const Peer*, PeerPending> pendingByPeer() const;
  // A call in flight as oldest() lists it.
  struct Pending {
    int64_t id = 0;
    const Peer* peer = nullptr;
    CallKind kind = CallKind::kOther;
    std::chrono::steady_clock::time_point sentAt{};
    std::chrono::milliseconds timeout{0}; // as Call's
  };
  // The `limit` calls in flight sent first, oldest first, and how many are
  // in flight in all (torch_rpc_ext.metrics.calls_in_flight: what a worker
  // waits on). A walk of the table under its lock, as pendingByPeer().
  std::pair<std::vector<Pending>, size_t> oldest(size_t limit) const;

  // Join the timeout thread. Idempotent.
  void stop();

 private:
  void timeoutLoop();

  ExpireFn onExpired_;
  std::function<void()> onTick_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::unordered_map<int64_t, Call> calls_;
  std::multimap<std::chrono::steady_clock::time_point, int64_t> deadlines_;
  // When the timeout thread will wake up by itself; max() while it is awake.
  std::chrono::steady_clock::time_point wakeAt_ =
      std::chrono::steady_clock::time_point::max();
  bool stopping_ = false;
  std::thread thread_;
};

} // namespace torch_rpc_ext
