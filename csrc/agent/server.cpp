// SPDX-License-Identifier: BSD-3-Clause
// The agent's server side (server.h).
#include "csrc/agent/server.h"

#include <torch/csrc/distributed/rpc/profiler/server_process_global_profiler.h>
#include <torch/csrc/distributed/rpc/utils.h>

#include <algorithm>
#include <optional>

#include "csrc/agent/call_trace.h"
#include "csrc/agent/thread_state.h"
#include "csrc/agent/tracing.h"
#include "csrc/common/logging.h"
#include "csrc/wire/codec.h"

namespace torch_rpc_ext {

void Server::serve(
    std::shared_ptr<transport::Connection> conn,
    c10::intrusive_ptr<rpc::Message> request,
    std::vector<c10::Stream> streams,
    Served served) {
  int64_t id = request->id();
  call_trace::stamp(id, call_trace::kServeStart);
  ServingTable::enter(served.ticket, ServingTable::Stage::kRunning);
  const bool costs = served.peer != nullptr && callCostsOn();
  const auto started = costs ? std::chrono::steady_clock::now()
                             : std::chrono::steady_clock::time_point{};
  if (costs) {
    served.peer->stats.costs.observeTime(
        CallCosts::kQueueSeconds, served.kind, started - served.arrived);
  }
  // Serve every request with the thread-local state this thread had before
  // it served any. Upstream's legacy profiler leaves per-thread state behind
  // after RUN_WITH_PROFILING_REQ, so a second profiled request on the same
  // thread would record no events (TensorPipe has the same bug; it is hit
  // there less often only because its pool rotates threads); so would a
  // function that turns off grad mode and never turns it back on.
  // Set when the serve starts: user code also runs on our threads outside
  // any serve (a call whose RRef arguments waited for their owner's
  // confirmation runs in that reply's completion, on the loop), and keeps
  // what it changes there. Set again when it ends, rather than restored to
  // what it was at the start, which may be such a leak. (A completion
  // thread, which never serves, checks around each completion instead:
  // thread_state.h.) Two sets, no capture: 2 x 320 ns against the guard's
  // 820 (save, set, restore; docs/performance.md, session 47).
  thread_state::reset();
  struct ResetAtExit {
    ~ResetAtExit() {
      thread_state::reset();
    }
  } resetAtExit;
  c10::intrusive_ptr<c10::ivalue::Future> result;
  std::shared_ptr<tracing::ServeSpan> span;
  try {
    // One stream per device of ours (those the request's CUDA tensors
    // arrived on): the user's function runs under them.
    if (streams.empty() && !options_.devices.empty()) {
      streams = devices_.arrivalStreams();
    }
    // Who holds which of our forks, for when a holder departs.
    rrefs_.trackForks(*request, conn->peerId());
    // While the function runs, its caller's trace context (tracing.h): the
    // callee's span is its child (a Python function's made in Python; a
    // builtin operator's or TorchScript function's here).
    tracing::Incoming traced(served.trace, served.landing);
    const bool named =
        !served.trace.empty() && served.kind == CallKind::kScript;
    if (named && rpc::profiler::processglobal::StateStackEntry::current()) {
      // Upstream's path serves it (under its server-side profiler), and
      // decodes it there: a span named for its kind, over all of it.
      span = tracing::beginServe(served.trace, "script");
    }
    {
      // Its span begins once the call is decoded, named by what it runs
      // (tracing.h, ScriptNaming).
      std::optional<tracing::ScriptNaming> naming;
      if (named && !span) {
        naming.emplace([&](const std::string& name) {
          span = tracing::beginServe(served.trace, name);
        });
      }
      ServingTable::InHandler inHandler(served.ticket);
      result = callback_(*request, std::move(streams));
    }
    if (named && !span) {
      // Not named by the decoder (a request it could not decode): a span
      // for what is left of it.
      span = tracing::beginServe(served.trace, "script");
    }
    call_trace::stamp(id, call_trace::kServeReturned);
  } catch (...) {
    // A future the handler returned stands (what failed after it, a span,
    // is not the caller's): its work may still be pending (RRef arguments
    // awaiting their owner), and the request's entry must outlive it
    // (serve_callback.cpp, resumed()).
    if (!result) {
      result =
          c10::make_intrusive<c10::ivalue::Future>(at::AnyClassType::get());
      result->setError(std::current_exception());
    }
  }
  // The callback has taken what it needs. Holding the request any longer
  // would keep its tensors referenced while the response is encoded, and a
  // tensor sent back unchanged (identity, in-place updates) could then not
  // hand its shared slab back without a copy (shm/slab.h).
  request.reset();
  bool async = !result->completed();
  if (async) {
    ++activeAsync_;
    // (Before the callback is added: only it moves the entry on. Unless a
    // resumed handler moved it first: its work runs on another thread.)
    ServingTable::leaveRunning(served.ticket);
  }
  result->addCallback(
      [this, owner = owner_, span, conn, id, async, served, started, costs](
          c10::ivalue::Future& f) {
        auto held = owner.lock();
        if (!held) {
          return;
        }
        // Counted out however the answer goes: a shutdown or a group's
        // leave waits for the table to empty.
        ServingTable::enter(served.ticket, ServingTable::Stage::kResponding);
        struct Served {
          Server& server;
          ServingTable::Ticket ticket;
          bool async;
          ~Served() {
            server.serving_.remove(ticket);
            if (async) {
              --server.activeAsync_;
            }
          }
        } done{*this, served.ticket, async};
        if (costs) {
          served.peer->stats.costs.observeTime(
              CallCosts::kServeSeconds,
              served.kind,
              std::chrono::steady_clock::now() - started);
        }
        if (span) {
          span->end(f.hasError() ? f.tryRetrieveErrorMessage() : std::string());
        }
        uint64_t bytes = 0;
        try {
          bytes = respond(*conn, id, f, served.peer);
        } catch (const std::exception& e) {
          // No answer could be written (not even the error's): the caller
          // learns of it by its timeout or the connection's close.
          logWarning(
              "torch_rpc_ext: no response to request " + std::to_string(id) +
              " on " + conn->describe() + ": " + e.what());
        }
        if (costs && bytes != 0) {
          served.peer->stats.costs.observe(
              CallCosts::kServedResponseBytes, served.kind, bytes);
        }
      });
}

uint64_t Server::respond(
    transport::Connection& conn,
    int64_t id,
    c10::ivalue::Future& result,
    const Peer* requester) {
  if (!running_.load()) {
    return 0;
  }
  call_trace::stamp(id, call_trace::kServeDone);
  c10::intrusive_ptr<rpc::Message> response;
  if (result.hasError()) {
    response =
        rpc::createExceptionResponse(result.tryRetrieveErrorMessage(), id);
  } else {
    try {
      response = result.value().toCustomClass<rpc::Message>();
    } catch (const std::exception& e) {
      // Torch's callback always makes a Message; anything else is answered.
      response = rpc::createExceptionResponse(
          std::string("the request's handler returned no message: ") + e.what(),
          id);
    }
  }
  // An error answer in the error's words (a c10::Error's without its C++
  // backtrace, which is the callee's business).
  auto errorFrame = [](const std::exception& e, int64_t id) {
    const auto* c10 = dynamic_cast<const c10::Error*>(&e);
    return wire::encodeMessage(
        rpc::createExceptionResponse(
            c10 ? c10->what_without_backtrace() : e.what(), id),
        id);
  };
  frame::OutboundFrame frame;
  std::vector<rpc::ForkId> returned; // forks of ours it carries, attributed
  bool refused = false; // not encodable: an error answer goes instead
  Peer* peer = group_.memberOn(conn.peerId(), conn.peerIncarnation());
  try {
    std::optional<wire::DeviceRoute> route;
    if (peer &&
        AgentDevices::needsRoute(
            options_.devices, peer->route.reverseDeviceMap, *response)) {
      // Back through the reverse of the caller's map. (This callback runs
      // under streams that wait for the result's events: the current ones.)
      route = devices_.routeTo(peer->info.name_, peer->route.reverseDeviceMap);
    } else if (!peer && AgentDevices::needsRoute({}, {}, *response)) {
      route = devices_.routeTo(std::to_string(conn.peerId()), {});
    }
    frame = wire::encodeMessage(response, id, route ? &*route : nullptr);
    AgentDevices::recordCudaUse(*response);
    TORCH_CHECK(
        frame.head.size() <= wire::kMaxHeadBytes,
        "RPC response describes ",
        response->tensors().size(),
        " tensors in ",
        frame.head.size(),
        " bytes of metadata: at most ",
        wire::kMaxHeadBytes,
        " (return fewer tensors, or fewer views: torch.stack or torch.cat "
        "them)");
    TORCH_CHECK(
        frame.segments.size() - 1 <= wire::kMaxStorages,
        "RPC response holds ",
        frame.segments.size() - 1,
        " distinct tensor storages: at most ",
        wire::kMaxStorages,
        " (return fewer tensors, or views of fewer storages: torch.stack "
        "them)");
    TORCH_CHECK(
        frame.wireSize() <= options_.maxFrameBytes,
        "RPC response of ",
        frame.wireSize(),
        " bytes exceeds max_frame_bytes=",
        options_.maxFrameBytes);
    // An RRef of ours returned (once the answer is sure to go). Where the
    // requester was declared dead before they were attributed to it (its
    // death applied while we served it), its departure has released what
    // it held already: these go now. (One that left may still read this
    // answer: its forks stay its own.)
    const Peer* holder = requester ? requester : peer;
    returned = rrefs_.trackOwnForks(*response, conn.peerId());
    if (!returned.empty() && holder && holder->declaredDead()) {
      rrefs_.dropForks(returned);
      returned.clear();
    }
  } catch (const std::exception& e) {
    // Refused (too large, not encodable): the forks of our RRefs it carries
    // go to nobody. Kept, they held graceful shutdown 100 s ("Leaking
    // RRef") until session 96.
    rrefs_.dropCarried(*response);
    frame = errorFrame(e, id);
    refused = true;
  }
  if (!refused) {
    // Queued and then dropped unwritten (the connection closed first), it
    // reached nobody either.
    frame.ifUnsent = rrefs_.ifUnsent(owner_, returned, response);
  }
  uint64_t bytes = frame.wireSize();
  try {
    if (!conn.write(std::move(frame))) {
      // The connection closed before the answer was queued: it reached
      // nobody, nor did the forks of our RRefs it carries.
      rrefs_.dropUndelivered(returned, *response);
    }
  } catch (const std::exception& e) {
    // Refused by the connection before anything was queued (a segment no
    // channel of it carries): the caller gets the error as its response.
    // Until session 58 it escaped into the loop's log, and the caller
    // waited for its timeout. What the answer carried goes to nobody.
    rrefs_.dropUndelivered(returned, *response);
    frame = errorFrame(e, id);
    bytes = frame.wireSize();
    conn.write(std::move(frame));
  }
  if (peer) {
    peer->stats.bytesSent.fetch_add(bytes, std::memory_order_relaxed);
  }
  call_trace::stamp(id, call_trace::kResponseWritten);
  return bytes;
}

void Server::addMetrics(std::unordered_map<std::string, std::string>& m) const {
  m["agent.server_active_calls"] = std::to_string(active());
  // Whole milliseconds since the oldest request being served was read: 0
  // if none is, at least 1 while one is (as rpc_ext.peer.<name>.
  // oldest_call_ms; torch_rpc_ext_oldest_request_age_seconds).
  int64_t oldestMs = 0;
  if (auto arrived = serving_.oldestArrival()) {
    oldestMs = std::max<int64_t>(
        1,
        std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::steady_clock::now() - *arrived)
            .count());
  }
  m["rpc_ext.oldest_request_ms"] = std::to_string(oldestMs);
  m["agent.server_active_async_calls"] = std::to_string(activeAsync_.load());
  m["rpc_ext.trace_contexts_ignored"] = std::to_string(tracesIgnored_.load());
}

} // namespace torch_rpc_ext
