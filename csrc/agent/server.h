// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The agent's server side: a request served through torch's request
// callback (ServeCallback: may take the GIL), its response encoded and
// written back on the connection it came from. Keeps the requests being
// served (serving_table.h: a dynamic group's leave waits for them, and
// /serving lists them).
//
// Threads: accepted() runs on the loop thread that read the request;
// serve() on that loop thread after its read pass (or a thread the loop
// handed itself to); the response is written from the result future's
// callback, on whatever thread completes it (at once for a synchronous
// function). The table has its lock; the counters are atomic, the rest is
// set at construction.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/rpc/request_callback.h>

#include "csrc/agent/devices.h"
#include "csrc/agent/group.h"
#include "csrc/agent/options.h"
#include "csrc/agent/rref_guard.h"
#include "csrc/agent/serving_table.h"
#include "csrc/agent/tracing.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext {

class Server {
 public:
  // `running`: the agent's (torch's) running flag; no response is written
  // once it is cleared. The rest outlive us.
  Server(
      rpc::RequestCallback& callback,
      const std::atomic<bool>& running,
      const AgentOptions& options,
      AgentDevices& devices,
      RRefGuard& rrefs,
      const Group& group)
      : callback_(callback),
        running_(running),
        options_(options),
        devices_(devices),
        rrefs_(rrefs),
        group_(group) {}

  // The agent that holds us: a response completing after it is gone is
  // dropped (set once, right after the agent is made).
  void setOwner(std::weak_ptr<void> owner) {
    owner_ = std::move(owner);
  }
  // Who sent a request, what it is and when it arrived: where its queue
  // wait, run time and response size are counted (peer_stats.h).
  struct Served {
    Peer* peer = nullptr;
    CallKind kind = CallKind::kOther;
    std::chrono::steady_clock::time_point arrived{};
    std::string trace; // the caller's traceparent, if it sent one
    // A traced request's CUDA tensors landing here (tracing.h), or zeros.
    tracing::Landing landing;
    ServingTable::Ticket ticket{}; // its entry among those served
  };
  // Request `id` from `served.peer` was read and will be served: its entry
  // in the table (served.ticket) and its arrival (served.arrived) are set.
  void accepted(int64_t id, Served& served) {
    std::tie(served.ticket, served.arrived) =
        serving_.add(id, served.peer, served.kind);
  }
  // A request's trace context was not a traceparent: ignored, counted
  // (rpc_ext.trace_contexts_ignored).
  void traceIgnored() {
    tracesIgnored_.fetch_add(1, std::memory_order_relaxed);
  }
  // Run the request (its CUDA tensors ready on `streams`, one per device of
  // ours) and arrange for its response.
  void serve(
      std::shared_ptr<transport::Connection> conn,
      c10::intrusive_ptr<rpc::Message> request,
      std::vector<c10::Stream> streams,
      Served served);
  int64_t active() const {
    return static_cast<int64_t>(serving_.size());
  }
  // The `limit` requests served longest, oldest first, and how many are
  // being served (torch_rpc_ext.metrics.requests_being_served).
  std::pair<std::vector<ServingTable::Serving>, size_t> oldest(
      size_t limit) const {
    return serving_.oldest(limit);
  }
  // agent.server_active_calls, agent.server_active_async_calls,
  // rpc_ext.oldest_request_ms, rpc_ext.trace_contexts_ignored.
  void addMetrics(std::unordered_map<std::string, std::string>& m) const;

 private:
  // The response's bytes on the wire (0: none sent). `requester`: who sent
  // the request, as it arrived (null if no member did).
  uint64_t respond(
      transport::Connection& conn,
      int64_t id,
      c10::ivalue::Future& result,
      const Peer* requester);

  rpc::RequestCallback& callback_;
  const std::atomic<bool>& running_;
  const AgentOptions& options_;
  AgentDevices& devices_;
  RRefGuard& rrefs_;
  const Group& group_;
  std::weak_ptr<void> owner_;
  ServingTable serving_;
  std::atomic<int64_t> activeAsync_{0};
  std::atomic<uint64_t> tracesIgnored_{0};
};

} // namespace torch_rpc_ext
