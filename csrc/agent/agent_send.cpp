// SPDX-License-Identifier: BSD-3-Clause
// The agent's traffic (agent.h): send() checks, encodes and writes a call
// (Calls settles it); what arrives is decoded on the loop thread, requests
// handed to the Server, responses to Calls.
#include "csrc/agent/agent.h"
#include "csrc/agent/call_trace.h"
#include "csrc/agent/tracing.h"

#include <torch/csrc/distributed/rpc/utils.h>
#include <torch/csrc/python_headers.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "csrc/common/exit_gate.h"
#include "csrc/common/logging.h"
#include "csrc/common/threads.h"
#include "csrc/wire/codec.h"

namespace torch_rpc_ext {

namespace {

std::chrono::milliseconds callTimeout(float seconds) {
  // From 1e9 s (31 years; infinity among them) on: no timeout, as 0 says,
  // and as such a value meant before session 94 (its cast was undefined,
  // and landed below 0); NaN likewise. (The deadline, now() + timeout in
  // the steady clock's int64 nanoseconds, holds about 9.2e9 s: 1e10 s
  // wrapped below now and failed the call at once.) Below 0: expired
  // already.
  constexpr double kNoneFromMs = 1e12;
  const double ms = static_cast<double>(seconds) * 1000;
  if (std::isnan(ms) || ms >= kNoneFromMs) {
    return std::chrono::milliseconds(0);
  }
  return std::chrono::milliseconds(
      static_cast<int64_t>(std::max(ms, -kNoneFromMs)));
}

} // namespace

c10::intrusive_ptr<JitFuture> Agent::send(
    const rpc::WorkerInfo& to,
    c10::intrusive_ptr<rpc::Message> message,
    const float rpcTimeoutSeconds,
    const rpc::DeviceMap& deviceMap) {
  TORCH_CHECK(
      rpcAgentRunning_.load(),
      "Node ",
      workerInfo_.id_,
      " tried to send() a message of type ",
      message->type(),
      " but RPC is no longer running on this node.");
  TORCH_CHECK(
      !ExitGate::closed(),
      "RPC from ",
      workerInfo_.name_,
      ": the process is exiting (call rpc.shutdown() before the end of the "
      "program)");
  TORCH_CHECK(
      message->isRequest(),
      "send() only carries requests, got message type ",
      message->type());
  TORCH_CHECK(
      !group_.fenced(),
      "RPC from ",
      workerInfo_.name_,
      " to ",
      to.name_,
      " failed: ",
      group_.fencedReason());
  Peer* peer = group_.peerById(to.id_);
  if (!peer || peer->info.name_ != to.name_ || peer->departed()) {
    // Forks of ours pickled into it would be held by nobody, for good.
    rrefs_.dropCarried(*message);
    auto gone = group_.lastPeerNamed(to.name_);
    TORCH_CHECK(
        !(gone && gone->departed()),
        "RPC to ",
        to.name_,
        " failed: ",
        gone ? gone->departure() : "");
    TORCH_CHECK(
        false, "unknown destination worker ", to.name_, " (id ", to.id_, ")");
  }
  if (auto refused = rrefs_.refuse(to.name_, *message, getDevices())) {
    return refused;
  }
  if (faults_) {
    if (auto error = faults_->failure(*message)) {
      auto failed =
          c10::make_intrusive<JitFuture>(at::AnyClassType::get(), getDevices());
      failed->setError(std::make_exception_ptr(std::runtime_error(*error)));
      return failed;
    }
  }

  // Its kind before profiling wraps it (RUN_WITH_PROFILING_REQ would count
  // every profiled call as "other").
  const CallKind kind = callKindOf(*message);
  // Under torch.profiler (Kineto) the callee profiles the call too.
  std::shared_ptr<CallProfile> profile = RemoteProfiling::begin(message);
  int64_t id = calls_.nextId();
  call_trace::stamp(id, call_trace::kSendEntry);
  // A traced call's phases (tracing.h): its first send's only.
  tracing::SendPhases* phases = nullptr;
  if (!tracing::outgoing().empty() && tracing::sendPhases().encodeStart == 0) {
    phases = &tracing::sendPhases();
    phases->encodeStart = tracing::wallNanos();
  }
  auto encodeSpan =
      RemoteProfiling::span(profile.get(), "torch_rpc_ext::encode");
  std::optional<wire::DeviceRoute> route;
  frame::OutboundFrame frame;
  try {
    if (!options_.devices.empty() || !options_.deviceMaps.empty() ||
        !deviceMap.empty() || AgentDevices::needsRoute({}, {}, *message)) {
      // A per-call map (dist autograd's backward pass) overrides the
      // options'.
      route = devices_.routeTo(
          to.name_, deviceMap.empty() ? getDeviceMap(to) : deviceMap);
    }
    // The caller's trace context, where torch_rpc_ext.tracing set one for
    // this thread's call (tracing.h).
    frame = wire::encodeMessage(
        message, id, route ? &*route : nullptr, tracing::outgoing());
  } catch (...) {
    // A tensor it cannot send (no device map for its device, a layout or
    // dtype it has no encoding for): never sent, so the forks of our RRefs
    // it carries are held by nobody. (Kept until session 98: "Leaking
    // RRef", a graceful shutdown 100 s later.)
    rrefs_.dropCarried(*message);
    throw;
  }
  AgentDevices::recordCudaUse(*message);
  uint64_t wireBytes = frame.wireSize();
  const size_t storages = frame.segments.size() - 1; // (the payload's)
  if (wireBytes > options_.maxFrameBytes || storages > wire::kMaxStorages ||
      frame.head.size() > wire::kMaxHeadBytes) {
    rrefs_.dropCarried(*message); // never sent: held by nobody
  }
  TORCH_CHECK(
      frame.head.size() <= wire::kMaxHeadBytes,
      "RPC message to ",
      to.name_,
      " describes ",
      message->tensors().size(),
      " tensors in ",
      frame.head.size(),
      " bytes of metadata: at most ",
      wire::kMaxHeadBytes,
      " (send fewer tensors, or fewer views: torch.stack or torch.cat them)");
  TORCH_CHECK(
      storages <= wire::kMaxStorages,
      "RPC message to ",
      to.name_,
      " holds ",
      storages,
      " distinct tensor storages: at most ",
      wire::kMaxStorages,
      " (send fewer tensors, or views of fewer storages: torch.stack them)");
  TORCH_CHECK(
      wireBytes <= options_.maxFrameBytes,
      "RPC message of ",
      wireBytes,
      " bytes to ",
      to.name_,
      " exceeds max_frame_bytes=",
      options_.maxFrameBytes);
  // An RRef of ours passed to `to`; gone already if `to` was declared dead
  // since the check above (its departure has released what it held).
  auto passed = rrefs_.trackOwnForks(*message, to.id_);
  if (!passed.empty() && peer->declaredDead()) {
    rrefs_.dropForks(passed);
  }
  encodeSpan.reset();
  call_trace::stamp(id, call_trace::kEncoded);
  if (phases) {
    phases->encodeEnd = tracing::wallNanos();
  }

  auto future =
      c10::make_intrusive<JitFuture>(at::AnyClassType::get(), getDevices());
  auto timeout = rpcTimeoutSeconds == rpc::kUnsetRpcTimeout
      ? getRpcTimeout()
      : callTimeout(rpcTimeoutSeconds);
  calls_.begin();
  std::shared_ptr<transport::Connection> conn;
  try {
    conn = connections_.connectionTo(*peer);
  } catch (...) {
    calls_.finished();
    rrefs_.dropUndelivered(passed, *message);
    throw;
  }
  RemoteProfiling::markSent(profile.get()); // before the call is visible
  const auto sentAt = std::chrono::steady_clock::now();
  const size_t alreadyInFlight = calls_.add(
      id,
      CallTable::Call{
          future,
          conn.get(),
          peer,
          timeout,
          sentAt + timeout,
          /*sentAlone=*/false,
          profile,
          /*arrival=*/{},
          sentAt,
          kind,
          kind == CallKind::kScript && !isThreadOfOurs() &&
              Py_IsInitialized() &&
              PyGILState_GetThisThreadState() != nullptr});
  auto& stats = peer->stats;
  stats.callsSent.fetch_add(1, std::memory_order_relaxed);
  stats.bytesSent.fetch_add(wireBytes, std::memory_order_relaxed);
  stats.costs.observe(CallCosts::kRequestBytes, kind, wireBytes);
  // Queued and then dropped unwritten (its connection closed first), it
  // reached nobody either: its forks go then.
  frame.ifUnsent = rrefs_.ifUnsent(weak_from_this(), passed, message);
  auto delay =
      faults_ ? faults_->delay(message->type()) : std::chrono::milliseconds(0);
  if (delay.count() == 0) {
    auto sendSpan = RemoteProfiling::span(profile.get(), "torch_rpc_ext::send");
    try {
      if (!calls_.write(conn, std::move(frame), id, *peer)) {
        rrefs_.dropUndelivered(passed, *message);
      }
    } catch (...) {
      rrefs_.dropUndelivered(passed, *message);
      throw;
    }
    call_trace::stamp(id, call_trace::kWritten);
    if (phases) {
      phases->sendEnd = tracing::wallNanos();
    }
    // A lone call (the rpc_sync pattern): let a sleeping loop start polling
    // for the response now, so its wake-up overlaps the peer's work instead
    // of following it. With calls already in flight (pipelined rpc_async)
    // responses keep the loop busy anyway, and a poller woken per call only
    // takes a core from the thread issuing them: measured 3.4x vs 4.2x
    // TensorPipe's throughput with polling on vs off.
    if (alreadyInFlight == 0) {
      conn->expectInput();
    }
    // A call made while serving one on a loop thread (a nested rpc_sync in
    // a UDF) is likely waited for there: that loop, which may have to read
    // the response, goes to another thread now, not after the loop's 2 ms
    // stall watch. Measured, a UDF making one nested call, 300 calls: 3.4
    // ms a call before (TensorPipe 1.4-1.7), see docs/performance.md.
    transport::handOffServingLoop();
  } else {
    // Held back (fault injection): the call's timeout runs meanwhile, as
    // it would on a slow network.
    auto held = std::make_shared<frame::OutboundFrame>(std::move(frame));
    auto self = shared_from_this();
    pool_.run([self, conn, held, id, peer, delay, message, passed] {
      std::this_thread::sleep_for(delay);
      try {
        if (!self->calls_.write(conn, std::move(*held), id, *peer)) {
          self->rrefs_.dropUndelivered(passed, *message);
        }
      } catch (const std::exception&) {
        // (The call failed with it: Calls::write.)
        self->rrefs_.dropUndelivered(passed, *message);
      }
    });
    // A call that times out before its message is even written is returned
    // failed, as FAULTY_TENSORPIPE (whose send() sleeps through the delay)
    // returns it: callbacks that the caller attaches then run on its own
    // thread, before it can look at the result. Upstream relies on this:
    // rpc.remote() to self marks its OwnerRRef timed out in such a callback,
    // and a future failed by another thread is seen completed before its
    // callbacks have run, so to_here() could pass the timed-out check and
    // wait forever for a value the late request can no longer set.
    if (timeout.count() != 0 && timeout <= delay) {
      future->wait(); // the timeout settles it; no callback is attached yet
    }
  }
  return future;
}

frame::InboundBuffers Agent::onFrameHead(
    transport::Connection& /*conn*/,
    const std::string& head,
    const std::vector<uint64_t>& segmentSizes,
    const std::vector<bool>& provided) {
  // A throw rejects the frame; onClosed counts it (rejectedPeer()).
  auto in =
      wire::InboundMessage::prepare(head, segmentSizes, buffers_, provided);
  auto buffers = in->buffers(in);
  devices_.markUnserved(*in, buffers);
  return buffers;
}

void Agent::onFrame(
    const std::shared_ptr<transport::Connection>& conn,
    std::string /*head*/,
    frame::InboundBuffers buffers) {
  auto* in = static_cast<wire::InboundMessage*>(buffers.keepAlive.get());
  if (call_trace::on()) {
    const bool request = (static_cast<uint32_t>(in->type()) &
                          rpc::MessageTypeFlags::REQUEST_TYPE) != 0;
    call_trace::stampAlways(
        in->id(),
        request ? call_trace::kRequestRead : call_trace::kResponseRead);
  }
  // Null: it departed (responses still count).
  Peer* peer = group_.memberOn(conn->peerId(), conn->peerIncarnation());
  c10::intrusive_ptr<rpc::Message> message;
  std::vector<c10::Stream> streams;
  tracing::Landing landing;
  try {
    const bool traced = !in->traceContext().empty();
    landing.start = traced ? tracing::wallNanos() : 0;
    message = devices_.finish(*in, buffers, streams, conn->peerId());
    // Only a landing of CUDA tensors (arrival streams) is worth a span.
    landing = traced && !streams.empty()
        ? tracing::Landing{landing.start, tracing::wallNanos()}
        : tracing::Landing{};
    // (The channels' regions went at the end of finish().)
  } catch (const ReceiveFailure& e) {
    buffers.regions.clear(); // (a release rides with the failure's frame)
    failReceive(conn, *in, peer, e.what());
    return;
  } catch (const std::exception& e) {
    if (peer) {
      peer->stats.rejectedFrames.fetch_add(1, std::memory_order_relaxed);
    }
    conn->close(std::string("rejected message: ") + e.what());
    logWarning(
        "torch_rpc_ext: rejected message from " + conn->describe() + ": " +
        e.what());
    return;
  }
  if (message->isRequest()) {
    if (refuseFromNonMember(*conn, peer)) {
      return;
    }
    peer->stats.bytesReceived.fetch_add(
        in->byteSize(), std::memory_order_relaxed);
    peer->stats.callsServed.fetch_add(1, std::memory_order_relaxed);
    Server::Served served{
        peer,
        callKindOf(*message), // (a profiled call's: what it wraps)
        {}, // (arrived: set by accepted())
        in->traceContext(),
        landing};
    if (in->traceIgnored()) {
      server_.traceIgnored();
    }
    peer->stats.costs.observe(
        CallCosts::kServedRequestBytes, served.kind, in->byteSize());
    server_.accepted(message->id(), served);
    // Served on this loop thread after the read pass: no hop (as a lone
    // call's response is completed: calls.cpp).
    auto self = shared_from_this();
    conn->runAfterDispatch(
        [self,
         conn,
         message = std::move(message),
         streams = std::move(streams),
         served]() mutable {
          self->server_.serve(
              std::move(conn), std::move(message), std::move(streams), served);
        },
        /*expectMore=*/true);
    return;
  }
  calls_.respond(*conn, std::move(message), std::move(streams), in->byteSize());
}

bool Agent::refuseFromNonMember(transport::Connection& conn, Peer* peer) {
  if (peer && !peer->departed()) {
    return false;
  }
  // Nothing a departed member sends is served: it drained its own calls
  // before leaving, or was declared dead (and is fenced).
  conn.close(
      "worker id " + std::to_string(conn.peerId()) +
      " is not a member of the group at epoch " +
      std::to_string(group_.view()->epoch));
  return true;
}

void Agent::failReceive(
    const std::shared_ptr<transport::Connection>& conn,
    const wire::InboundMessage& in,
    Peer* peer,
    const std::string& cause) {
  const bool request = (static_cast<uint32_t>(in.type()) &
                        rpc::MessageTypeFlags::REQUEST_TYPE) != 0;
  const std::string from = peer ? peer->info.name_ : conn->describe();
  const std::string text = workerInfo_.name_ + " could not receive the " +
      (request ? "request from " : "response from ") + from + ": " + cause;
  // Once, here; the caller's error says the same.
  logWarning("torch_rpc_ext: " + text);
  if (!request) {
    calls_.respond(
        *conn, rpc::createExceptionResponse(text, in.id()), {}, in.byteSize());
    return;
  }
  if (refuseFromNonMember(*conn, peer)) {
    return;
  }
  peer->stats.bytesReceived.fetch_add(in.byteSize(), std::memory_order_relaxed);
  c10::intrusive_ptr<rpc::Message> reply;
  try {
    reply = RRefGuard::failRemote(*in.withoutTensors(), text);
  } catch (const std::exception& e) {
    logWarning(
        std::string("torch_rpc_ext: failing a remote() call's OwnerRRef: ") +
        e.what());
  }
  if (!reply) {
    reply = rpc::createExceptionResponse(text, in.id());
  }
  frame::OutboundFrame frame = wire::encodeMessage(reply, in.id());
  peer->stats.bytesSent.fetch_add(frame.wireSize(), std::memory_order_relaxed);
  conn->write(std::move(frame));
}

void Agent::onConnectionClosed(
    transport::Connection& conn,
    const std::string& reason) {
  calls_.connectionLost(conn, reason, shuttingDown_.load());
}

} // namespace torch_rpc_ext
