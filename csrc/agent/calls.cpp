// SPDX-License-Identifier: BSD-3-Clause
// The agent's client calls (calls.h): written, answered, expired, lost,
// settled.
#include "csrc/agent/calls.h"

#include <c10/core/StreamGuard.h>

#include <torch/csrc/distributed/rpc/utils.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/util/Exception.h>

#include "csrc/agent/arrival_completion.h"
#include "csrc/agent/call_trace.h"
#include "csrc/agent/held_gil.h"
#include "csrc/agent/thread_state.h"
#include "csrc/common/exit_gate.h"
#include "csrc/common/logging.h"
#include "csrc/common/python_state.h"

namespace torch_rpc_ext {

namespace {

// Completion threads added when all are blocked stop at this many.
constexpr size_t kMaxCompletionThreads = 4096;

// kRpcTimeoutErrorStr with its "{}" replaced by `ms` (fmt is not exported
// by libtorch, so it cannot be linked from an extension).
std::string timeoutText(int64_t ms) {
  std::string text = rpc::kRpcTimeoutErrorStr;
  auto at = text.find("{}");
  return text.replace(at, 2, std::to_string(ms));
}

// Calls::finished() at the end of a scope, however it ends.
struct FinishedAtExit {
  explicit FinishedAtExit(Calls& calls) : calls(calls) {}
  ~FinishedAtExit() {
    calls.finished();
  }
  Calls& calls;
};

} // namespace

Calls::Calls(std::string self, ThreadPool& pool, std::function<void()> onTick)
    : self_(std::move(self)),
      pool_(pool),
      completions_(
          1,
          kMaxCompletionThreads,
          std::chrono::milliseconds(20),
          "rpcx-complete"),
      table_(
          [this](int64_t /*id*/, CallTable::Call call) {
            auto ms = call.timeout.count();
            call.peer->stats.timeouts.fetch_add(1, std::memory_order_relaxed);
            settleWithError(
                std::move(call),
                rpc::makeRPCError(timeoutText(ms), rpc::RPCErrorType::TIMEOUT));
          },
          std::move(onTick)) {}

void Calls::begin() {
  std::lock_guard<std::mutex> lock(countMutex_);
  ++active_;
}

void Calls::finished() {
  {
    std::lock_guard<std::mutex> lock(countMutex_);
    --active_;
  }
  countCv_.notify_all();
}

bool Calls::write(
    const std::shared_ptr<transport::Connection>& conn,
    frame::OutboundFrame frame,
    int64_t id,
    Peer& peer) {
  bool written = false;
  try {
    written = conn->write(std::move(frame));
  } catch (const std::exception& e) {
    // Refused before anything was queued (a segment that no channel of the
    // connection carries): the call leaves the table now, failed with the
    // error that send() also raises to its caller. Until session 58 it
    // stayed there until its timeout, and rpc.shutdown() waited for it
    // (60 s by default).
    if (auto call = table_.take(id)) {
      peer.stats.errors.fetch_add(1, std::memory_order_relaxed);
      settleWithError(std::move(*call), e.what());
    }
    throw;
  }
  // If the connection closed before the call was registered, the close has
  // already swept the table: fail the call here so it is not orphaned.
  if (!written || conn->isClosed()) {
    if (auto call = table_.take(id)) {
      peer.stats.errors.fetch_add(1, std::memory_order_relaxed);
      // A close with no reason is our shutdown's (as connectionLost says).
      const std::string reason = conn->closeReason();
      settleWithError(
          std::move(*call),
          "RPC to " + peer.info.name_ + " failed: connection " +
              conn->describe() + " is closed: " +
              (reason.empty() ? "RPC agent is shutting down" : reason));
    }
  }
  return written;
}

void Calls::respond(
    transport::Connection& conn,
    c10::intrusive_ptr<rpc::Message> response,
    std::vector<c10::Stream> streams,
    uint64_t bytes) {
  size_t remaining = 0;
  auto call = table_.take(response->id(), &remaining);
  if (!call) {
    // Its caller gave up (timeout) or the id is bogus; nothing to settle.
    lateResponses_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  auto& stats = call->peer->stats;
  stats.bytesReceived.fetch_add(bytes, std::memory_order_relaxed);
  if (callCostsOn()) {
    stats.costs.observeTime(
        CallCosts::kCallSeconds,
        call->kind,
        std::chrono::steady_clock::now() - call->sentAt);
    stats.costs.observe(CallCosts::kResponseBytes, call->kind, bytes);
  }
  call->arrival = std::move(streams);
  settle(conn, std::move(*call), std::move(response), remaining == 0);
}

void Calls::settle(
    transport::Connection& conn,
    CallTable::Call call,
    c10::intrusive_ptr<rpc::Message> response,
    bool lastInFlight) {
  // Held by what is queued: the agent outlives its calls' completions.
  auto owner = owner_.lock();
  if (call.profile) {
    // Reported on the callee's track, then completed (remote_profiling.h).
    auto profile = std::move(call.profile);
    const Peer* peer = call.peer; // read before the lambda takes call
    profiling_.finish(
        static_cast<int32_t>(peer->info.id_),
        peer->incarnation,
        peer->info.name_,
        std::move(profile),
        std::move(response),
        [this, owner, call = std::move(call)](
            c10::intrusive_ptr<rpc::Message> reply) mutable {
          // Callbacks may block (a nested rpc_sync): the completion
          // thread grows, a track does not.
          completions_.run([this,
                            owner,
                            call = std::move(call),
                            reply = std::move(reply)]() mutable {
            complete(call, std::move(reply));
            // (Every completion task retires its future: retire() lets a
            // batch go only when the queue is empty or the batch full.)
            retire(std::move(call.future));
          });
        });
    return;
  }
  const bool lone = call.sentAlone && lastInFlight;
  if (!lone) {
    // One of several calls in flight (pipelined rpc_async, or concurrent
    // callers): completed on the completion thread. Its callbacks usually
    // take the GIL (torch converts the response to a Python object), which
    // the thread issuing the calls holds most of the time; on the loop that
    // wait stalled the reading of every other response (and after 2 ms
    // handed the loop to a new thread, which then stalled the same way).
    // Measured, 2000 pipelined calls, 3 alternating runs of 7 bursts:
    // 37.0k/22.4k/20.1k -> 43.5k/31.9k/25.6k calls/s (median burst), loop
    // takeovers per 7 bursts 2-27 -> 0 (docs/performance.md).
    if (call.completeHoldingGil && pythonUsable()) {
      bool queueTask = false;
      {
        std::lock_guard<std::mutex> lock(heldMutex_);
        held_.emplace_back(std::move(call), std::move(response));
        queueTask = heldNeedsTaskLocked();
      }
      if (queueTask) {
        completions_.run([this, owner] { completeHoldingGil(owner); });
      }
      return;
    }
    completions_.run([this,
                      owner,
                      call = std::move(call),
                      response = std::move(response)]() mutable {
      complete(call, std::move(response));
      retire(std::move(call.future));
    });
    return;
  }
  // A lone call completed (the rpc_sync pattern): on the loop thread that
  // read the response, right after the read pass, so the waiting caller is
  // woken straight from here with no hop. Then poll instead of sleeping: the
  // caller is about to send its next call. Keeping this core busy also makes
  // waking that caller cheap: on this VM a wake-up onto an idle (halted)
  // vCPU costs ~25 us. Measured, 4 alternating runs of 3000 calls: builtin
  // 51.8 -> 29.7 us, Python UDF 54.9 -> 31.3 us.
  conn.runAfterDispatch(
      [this,
       owner,
       call = std::move(call),
       response = std::move(response)]() mutable {
        complete(call, std::move(response));
      },
      /*expectMore=*/true);
}

void Calls::completeHoldingGil(const std::shared_ptr<void>& owner) {
  // Builtin and TorchScript calls sent by a user's Python thread
  // (CallTable::Call::completeHoldingGil): each completion takes the GIL (torch
  // converts the response to a Python object), and the thread issuing pipelined
  // calls gives the GIL up and takes it back at every call, so one acquisition
  // per completion was a hand-off (a futex wake and a context switch on
  // each side) per call. One task completes those queued in a row, up to
  // kHoldFor (then the issuing thread's turn), under one acquisition, and
  // drops their futures in it (torch's PyObject preservation takes the GIL
  // there too: retire()). Measured, bursts of 2000 rpc_async(torch.add), 5
  // alternating pairs: CPU per call, both processes, median 88 -> 73 us
  // (docs/performance.md, "Pipelined completions under one hold of the
  // GIL").
  //
  // A call queued while a task of these takes calls off the queue (it
  // waits for the GIL, or is between two completions: heldDrainers_) is
  // left to that task. While every such task is inside a completion, whose
  // callbacks may wait (letting the GIL go) for a later call of the queue,
  // a task is queued for the calls behind it (heldTaskQueued_): the pool
  // runs it on a thread it adds if this one stalls, as it would any
  // stalled completion. So a thread waiting for the GIL never has another
  // queued behind it for the same calls, and the pool does not grow while
  // the issuing thread holds the GIL. One call at a time off the queue,
  // never several taken ahead, for the same reason.
  constexpr unsigned kHoldFor = 32;
  bool none = false;
  {
    std::lock_guard<std::mutex> lock(heldMutex_);
    heldTaskQueued_ = false;
    none = held_.empty(); // an earlier task completed them
    if (!none) {
      ++heldDrainers_;
    }
  }
  if (none) {
    // Futures retire() kept because this task was queued go with it all
    // the same (below, as a hold ends).
    bool kept = false;
    {
      std::lock_guard<std::mutex> lock(retiredMutex_);
      kept = !retired_.empty();
    }
    if (kept && pythonUsable() && !ExitGate::closed()) {
      pybind11::gil_scoped_acquire gil;
      std::vector<c10::intrusive_ptr<c10::ivalue::Future>> batch;
      {
        std::lock_guard<std::mutex> lock(retiredMutex_);
        batch.swap(retired_);
        retireBatches_ += batch.empty() ? 0 : 1;
      }
    }
    return;
  }
  // This task counts among the drainers while it waits for the GIL and
  // between completions; it leaves them (queueing a task for the calls
  // behind, if no other drainer takes them) inside a completion and when
  // it ends, however it ends.
  struct Draining {
    Calls& calls;
    const std::shared_ptr<void>& owner;
    bool in = true;
    void enter() {
      std::lock_guard<std::mutex> lock(calls.heldMutex_);
      ++calls.heldDrainers_;
      in = true;
    }
    void leave() {
      if (!in) {
        return;
      }
      in = false;
      bool queueTask = false;
      {
        std::lock_guard<std::mutex> lock(calls.heldMutex_);
        --calls.heldDrainers_;
        queueTask = !calls.held_.empty() && calls.heldNeedsTaskLocked();
      }
      if (queueTask) {
        calls.completions_.run([&calls = calls, owner = owner] {
          calls.completeHoldingGil(owner);
        });
      }
    }
    ~Draining() {
      leave();
    }
  } draining{*this, owner};
  // (Python finalising: completed as before, each callback on its own.)
  std::optional<pybind11::gil_scoped_acquire> gil;
  std::optional<held_gil::Hold> hold; // (held_gil.h: what must let it go)
  if (pythonUsable()) {
    gil.emplace();
    hold.emplace();
    gilHolds_.fetch_add(1, std::memory_order_relaxed);
  }
  // Futures retire() kept for a later completion's batch (this task was
  // queued then) go as this one ends, under its hold: a hold drops only
  // its own calls' futures, and an answer (its tensors) kept there stayed
  // until some other call completed, if any ever did.
  struct DropRetired {
    Calls& calls;
    bool withGil;
    ~DropRetired() {
      if (!withGil || ExitGate::closed()) {
        return;
      }
      std::vector<c10::intrusive_ptr<c10::ivalue::Future>> batch;
      {
        std::lock_guard<std::mutex> lock(calls.retiredMutex_);
        if (!calls.retired_.empty()) {
          batch.swap(calls.retired_);
          ++calls.retireBatches_;
        }
      }
    }
  } dropRetired{*this, gil.has_value()};
  for (unsigned n = 0; n < kHoldFor; ++n) {
    // The process exits: no more user code here (common/exit_gate.h).
    if (ExitGate::closed()) {
      return;
    }
    std::optional<std::pair<CallTable::Call, c10::intrusive_ptr<rpc::Message>>>
        next;
    {
      std::lock_guard<std::mutex> lock(heldMutex_);
      if (held_.empty()) {
        return;
      }
      next.emplace(std::move(held_.front()));
      held_.pop_front();
      ++heldCount_;
    }
    draining.leave(); // inside a completion: not taking calls
    complete(next->first, std::move(next->second));
    next.reset(); // the future with it, under the GIL
    draining.enter();
  }
  // kHoldFor done: the issuing thread's turn (draining leaves).
}

bool Calls::heldNeedsTaskLocked() {
  if (heldDrainers_ > 0 || heldTaskQueued_) {
    return false;
  }
  heldTaskQueued_ = true;
  return true;
}

void Calls::retire(c10::intrusive_ptr<c10::ivalue::Future> future) {
  // Dropping a completed future takes the GIL when its value's tensors are
  // Python's too, as a returned tensor is once torch has converted it (its
  // PyObject preservation: the C++ side's reference to the Python object
  // goes with the last C++ reference): a second GIL hand-off per call,
  // beside torch's conversion. Dropped here in batches under one
  // acquisition: at most kRetireBatch held, none once the queue is empty
  // (a burst's last completion lets them all go). docs/performance.md,
  // "The completion thread's second GIL hand-off".
  constexpr size_t kRetireBatch = 32;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> batch;
  {
    std::lock_guard<std::mutex> lock(retiredMutex_);
    retired_.push_back(std::move(future));
    ++retiredCount_;
    if (retired_.size() < kRetireBatch && completions_.queued() > 0) {
      return;
    }
    batch.swap(retired_);
    ++retireBatches_;
  }
  if (pythonUsable()) {
    pybind11::gil_scoped_acquire gil;
    batch.clear();
  }
}

namespace {
thread_local const c10::ivalue::Future* tCompletingOnArrival = nullptr;
} // namespace

const c10::ivalue::Future* futureCompletingOnArrival() {
  return tCompletingOnArrival;
}

CompletingOnArrival::CompletingOnArrival(const c10::ivalue::Future* future)
    : outer_(tCompletingOnArrival) {
  tCompletingOnArrival = future;
}

CompletingOnArrival::~CompletingOnArrival() {
  tCompletingOnArrival = outer_;
}

void Calls::complete(
    CallTable::Call& call,
    c10::intrusive_ptr<rpc::Message> response) {
  // Counted as finished even if a callback of the future throws (upstream's
  // RRef callbacks do when a notification failed).
  FinishedAtExit finished(*this);
  // Always on a thread of ours (a loop thread after its read pass, or the
  // completion thread; never inline under user code): the callbacks, and a
  // call whose RRef arguments waited for this reply, run user code here,
  // which may leave grad mode off or a profiler on; the next user code on
  // this thread must not start from that.
  thread_state::CheckedScope checked;
  // The future records its events on the streams the tensors arrived on;
  // a waiter's stream then waits for them, never the host.
  c10::MultiStreamGuard streams(call.arrival);
  CompletingOnArrival onArrival(call.future.get());
  const int64_t id = response->id();
  call_trace::stamp(id, call_trace::kCompleting);
  if (response->type() == rpc::MessageType::EXCEPTION) {
    // An error answer (a builtin operator's or TorchScript function's
    // failure, a request the callee could not take) fails the call: counted
    // as those a lost connection fails are. (A Python function's exception
    // comes back as its result, a RemoteException, as upstream's.)
    if (call.peer != nullptr) {
      call.peer->stats.errors.fetch_add(1, std::memory_order_relaxed);
    }
    std::string text(response->payload().begin(), response->payload().end());
    call.future->setErrorIfNeeded(
        std::make_exception_ptr(std::runtime_error(text)));
  } else {
    // With the storages named: a future with devices cannot look inside a
    // Message to find them. A CPU future never reads them (torch's
    // markCompleted), so none are collected for it: walking the message's
    // tensors was 2% of the completion thread's time in a pipelined run.
    if (call.future->devices().empty()) {
      call.future->markCompleted(c10::IValue(response));
    } else {
      auto storages = response->getStorages();
      call.future->markCompleted(c10::IValue(response), std::move(storages));
    }
  }
  call_trace::stamp(id, call_trace::kCompleted);
}

void Calls::settleWithError(CallTable::Call call, std::string error) {
  if (call.profile) {
    // Timed out, lost or refused: its wait still goes in the trace.
    RemoteProfiling::reportUnanswered(*call.profile, call.peer->info.name_);
  }
  auto future = call.future;
  auto task = [this, future, error = std::move(error)] {
    FinishedAtExit finished(*this);
    try {
      future->setErrorIfNeeded(
          std::make_exception_ptr(std::runtime_error(error)));
    } catch (const c10::Error& e) {
      // A callback threw (upstream's RRef callbacks rethrow the error).
      logWarning(
          "torch_rpc_ext: a callback of a failed call threw: " +
          std::string(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      logWarning(
          "torch_rpc_ext: a callback of a failed call threw: " +
          std::string(e.what()));
    }
  };
  // After shutdown the pool no longer runs tasks; settle inline then
  // (wherever the failure was found, a user's thread among them: no reset).
  if (closed_.load()) {
    task();
  } else {
    pool_.run([task = std::move(task)] {
      thread_state::CheckedScope checked;
      task();
    });
  }
}

void Calls::connectionLost(
    transport::Connection& conn,
    const std::string& reason,
    bool quiet) {
  auto failed = table_.takeConnection(&conn);
  if (failed.empty()) {
    // A peer's connection we closed because it broke the protocol is worth
    // a line even with no call of ours on it.
    if (!conn.isOutbound() && conn.peerId() >= 0 && !quiet &&
        conn.rejectedPeer()) {
      logWarning(
          "torch_rpc_ext: " + self_ + " closed connection " + conn.describe() +
          ": " + reason);
    }
    return;
  }
  if (!quiet) {
    std::string line = "torch_rpc_ext: " + self_ + " lost connection " +
        conn.describe() + " with " + std::to_string(failed.size()) +
        " calls pending: " + reason;
    // A dial that never authenticated (a peer gone, a server held off) is
    // retried by each call: a caller's retry loop would write a line per
    // try. Each call's error says it too.
    if (conn.isOutbound() && conn.peerId() < 0) {
      logWarningLimited("dial_failed_with_calls", line);
    } else {
      logWarning(line);
    }
  }
  const Peer* peer = failed.front().second.peer;
  std::string why = reason.empty() ? "RPC agent is shutting down" : reason;
  for (auto& [id, call] : failed) {
    call.peer->stats.errors.fetch_add(1, std::memory_order_relaxed);
    settleWithError(
        std::move(call),
        "RPC to " + peer->info.name_ + " failed: connection " +
            conn.describe() + " lost: " + why);
  }
}

void Calls::drain(
    std::optional<std::chrono::steady_clock::time_point> deadline,
    float timeout) {
  std::unique_lock<std::mutex> lock(countMutex_);
  auto idle = [this] { return active_ == 0; };
  if (!deadline) {
    countCv_.wait(lock, idle);
    return;
  }
  TORCH_CHECK(
      countCv_.wait_until(lock, *deadline, idle),
      "RPC join timed out after ",
      timeout,
      " s: ",
      active_,
      " calls of ",
      self_,
      " are still waiting for responses");
}

void Calls::failAll(const std::string& why) {
  for (auto& [id, call] : table_.takeAll()) {
    settleWithError(std::move(call), why);
  }
}

void Calls::stop() {
  table_.stop();
  // Report what the profiling tracks still hold; they hand completions to
  // the completion thread, which then completes what it holds (never
  // dropped: each is a caller waiting).
  profiling_.stop();
  completions_.stop();
}

void Calls::addMetrics(std::unordered_map<std::string, std::string>& m) {
  {
    std::lock_guard<std::mutex> lock(countMutex_);
    m["agent.client_active_calls"] = std::to_string(active_);
  }
  m["rpc_ext.late_responses"] = std::to_string(lateResponses_.load());
  uint64_t held = 0;
  {
    std::lock_guard<std::mutex> lock(heldMutex_);
    held = heldCount_;
  }
  // Every future the completion thread dropped: in batches (retire()) or
  // in a hold of the GIL (completeHoldingGil()).
  std::lock_guard<std::mutex> lock(retiredMutex_);
  m["rpc_ext.completions.retired_futures"] =
      std::to_string(retiredCount_ + held);
  m["rpc_ext.completions.retire_batches"] = std::to_string(retireBatches_);
  m["rpc_ext.completions.held_gil"] = std::to_string(held);
  m["rpc_ext.completions.gil_holds"] = std::to_string(gilHolds_.load());
}

} // namespace torch_rpc_ext
