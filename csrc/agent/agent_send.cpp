// SPDX-License-Identifier: BSD-3-Clause
// The client side of a call (agent.h): send() encodes and writes it, the
// loop thread decodes what arrives (responses settle their calls, requests
// go to serving.cpp), and every call ends settled exactly once: by its
// response, its timeout, its connection's loss, or shutdown.
#include "csrc/agent/agent.h"

#include <c10/core/StreamGuard.h>

#include <torch/csrc/distributed/rpc/utils.h>

#include <thread>

#include "csrc/common/exit_gate.h"
#include "csrc/common/logging.h"
#include "csrc/wire/codec.h"

namespace torch_rpc_ext {

namespace {

std::chrono::milliseconds callTimeout(float seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
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

  // Under torch.profiler (Kineto) the callee profiles the call too.
  std::shared_ptr<CallProfile> profile = RemoteProfiling::begin(message);
  int64_t id = nextId_.fetch_add(1, std::memory_order_relaxed);
  auto encodeSpan =
      RemoteProfiling::span(profile.get(), "torch_rpc_ext::encode");
  std::optional<wire::DeviceRoute> route;
  if (!options_.devices.empty()) {
    // A per-call map (dist autograd's backward pass) overrides the options'.
    route = devices_.routeTo(
        to.name_, deviceMap.empty() ? getDeviceMap(to) : deviceMap);
  }
  frame::OutboundFrame frame =
      wire::encodeMessage(message, id, route ? &*route : nullptr);
  AgentDevices::recordCudaUse(*message);
  if (worldSize_ == 0) {
    rrefs_.trackOwnForks(*message, to.id_); // an RRef of ours passed to `to`
  }
  encodeSpan.reset();
  uint64_t wireBytes = frame.wireSize();
  TORCH_CHECK(
      wireBytes <= options_.maxFrameBytes,
      "RPC message of ",
      wireBytes,
      " bytes to ",
      to.name_,
      " exceeds max_frame_bytes=",
      options_.maxFrameBytes);

  auto future =
      c10::make_intrusive<JitFuture>(at::AnyClassType::get(), getDevices());
  auto timeout = rpcTimeoutSeconds == rpc::kUnsetRpcTimeout
      ? getRpcTimeout()
      : callTimeout(rpcTimeoutSeconds);
  {
    std::lock_guard<std::mutex> lock(callCountMutex_);
    ++clientActiveCalls_;
  }
  std::shared_ptr<transport::Connection> conn;
  try {
    conn = connections_.connectionTo(*peer);
  } catch (...) {
    callFinished();
    throw;
  }
  RemoteProfiling::markSent(profile.get()); // before the call is visible
  const size_t alreadyInFlight = calls_.add(
      id,
      CallTable::Call{
          future,
          conn.get(),
          peer,
          timeout,
          std::chrono::steady_clock::now() + timeout,
          /*sentAlone=*/false,
          profile,
          /*arrival=*/{}});
  auto& stats = peer->stats;
  stats.callsSent.fetch_add(1, std::memory_order_relaxed);
  stats.bytesSent.fetch_add(wireBytes, std::memory_order_relaxed);
  auto delay =
      faults_ ? faults_->delay(message->type()) : std::chrono::milliseconds(0);
  if (delay.count() == 0) {
    auto sendSpan = RemoteProfiling::span(profile.get(), "torch_rpc_ext::send");
    writeRequest(conn, std::move(frame), id, *peer);
    // A lone call (the rpc_sync pattern): let a sleeping loop start polling
    // for the response now, so its wake-up overlaps the peer's work instead
    // of following it. With calls already in flight (pipelined rpc_async)
    // responses keep the loop busy anyway, and a poller woken per call only
    // takes a core from the thread issuing them: measured 3.4x vs 4.2x
    // TensorPipe's throughput with polling on vs off.
    if (alreadyInFlight == 0) {
      conn->expectInput();
    }
  } else {
    // Held back (fault injection): the call's timeout runs meanwhile, as
    // it would on a slow network.
    auto held = std::make_shared<frame::OutboundFrame>(std::move(frame));
    auto self = shared_from_this();
    pool_.run([self, conn, held, id, peer, delay] {
      std::this_thread::sleep_for(delay);
      self->writeRequest(conn, std::move(*held), id, *peer);
    });
    // A call that times out before its message is even written is returned
    // failed, as FAULTY_TENSORPIPE (whose send() sleeps through the delay)
    // returns it: callbacks that the caller attaches then run on its own
    // thread, before it can look at the result. Upstream relies on this:
    // rpc.remote() to self marks its OwnerRRef timed out in such a callback,
    // and a future failed by another thread is seen completed before its
    // callbacks have run, so to_here() could pass the timed-out check and
    // wait forever for a value the late request can no longer set.
    if (timeout.count() > 0 && timeout <= delay) {
      future->wait(); // the timeout settles it; no callback is attached yet
    }
  }
  return future;
}

void Agent::writeRequest(
    const std::shared_ptr<transport::Connection>& conn,
    frame::OutboundFrame frame,
    int64_t id,
    Peer& peer) {
  // If the connection closed before the call was registered, onClosed has
  // already swept the table: fail the call here so it is not orphaned.
  if (!conn->write(std::move(frame)) || conn->isClosed()) {
    if (auto call = calls_.take(id)) {
      peer.stats.errors.fetch_add(1, std::memory_order_relaxed);
      settleWithError(
          std::move(*call),
          "RPC to " + peer.info.name_ + " failed: connection " +
              conn->describe() + " is closed: " + conn->closeReason());
    }
  }
}

void Agent::settle(
    transport::Connection& conn,
    CallTable::Call call,
    c10::intrusive_ptr<rpc::Message> response,
    bool lastInFlight) {
  auto self = shared_from_this();
  if (call.profile) {
    // Reported on the callee's track, then completed (remote_profiling.h).
    auto profile = std::move(call.profile);
    const Peer* peer = call.peer; // read before the lambda takes call
    profiling_.finish(
        static_cast<int32_t>(peer->info.id_),
        peer->info.name_,
        std::move(profile),
        std::move(response),
        [self, call = std::move(call)](
            c10::intrusive_ptr<rpc::Message> reply) mutable {
          // Callbacks may block (a nested rpc_sync): the completion
          // thread grows, a track does not.
          self->completions_.run([self,
                                  call = std::move(call),
                                  reply = std::move(reply)]() mutable {
            self->complete(call, std::move(reply));
          });
        });
    return;
  }
  const bool lone = call.sentAlone && lastInFlight;
  auto completion =
      [self, call = std::move(call), response = std::move(response)]() mutable {
        self->complete(call, std::move(response));
      };
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
    self->completions_.run(std::move(completion));
    return;
  }
  // A lone call completed (the rpc_sync pattern): on the loop thread that
  // read the response, right after the read pass, so the waiting caller is
  // woken straight from here with no hop. Then poll instead of sleeping: the
  // caller is about to send its next call. Keeping this core busy also makes
  // waking that caller cheap: on this VM a wake-up onto an idle (halted)
  // vCPU costs ~25 us. Measured, 4 alternating runs of 3000 calls: builtin
  // 51.8 -> 29.7 us, Python UDF 54.9 -> 31.3 us.
  conn.runAfterDispatch(std::move(completion), /*expectMore=*/true);
}

void Agent::complete(
    CallTable::Call& call,
    c10::intrusive_ptr<rpc::Message> response) {
  // Counted as finished even if a callback of the future throws (upstream's
  // RRef callbacks do when a notification failed).
  CallFinished finished(*this);
  // The future records its events on the streams the tensors arrived on;
  // a waiter's stream then waits for them, never the host.
  c10::MultiStreamGuard streams(call.arrival);
  if (response->type() == rpc::MessageType::EXCEPTION) {
    std::string text(response->payload().begin(), response->payload().end());
    call.future->setErrorIfNeeded(
        std::make_exception_ptr(std::runtime_error(text)));
  } else {
    // With the storages named: a future with devices cannot look inside a
    // Message to find them.
    auto storages = response->getStorages();
    call.future->markCompleted(c10::IValue(response), std::move(storages));
  }
}

void Agent::settleWithError(CallTable::Call call, std::string error) {
  auto future = call.future;
  auto task = [this, future, error = std::move(error)] {
    CallFinished finished(*this);
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
  // After shutdown the pool no longer runs tasks; settle inline then.
  if (shutdownDone_.load()) {
    task();
  } else {
    pool_.run(std::move(task));
  }
}

void Agent::callFinished() {
  {
    std::lock_guard<std::mutex> lock(callCountMutex_);
    --clientActiveCalls_;
  }
  callCountCv_.notify_all();
}

frame::InboundBuffers Agent::onFrameHead(
    transport::Connection& /*conn*/,
    const std::string& head,
    const std::vector<uint64_t>& segmentSizes,
    const std::vector<bool>& provided) {
  // A throw rejects the frame; onClosed counts it (rejectedPeer()).
  auto in =
      wire::InboundMessage::prepare(head, segmentSizes, buffers_, provided);
  return in->buffers(in);
}

void Agent::onFrame(
    const std::shared_ptr<transport::Connection>& conn,
    std::string /*head*/,
    frame::InboundBuffers buffers) {
  auto* in = static_cast<wire::InboundMessage*>(buffers.keepAlive.get());
  // Null: it departed (responses still count).
  Peer* peer = group_.memberOn(conn->peerId(), conn->peerIncarnation());
  c10::intrusive_ptr<rpc::Message> message;
  std::vector<c10::Stream> streams;
  try {
    message = devices_.finish(*in, buffers, streams);
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
    if (!peer || peer->departed()) {
      // Nothing a departed member sends is served: it drained its own calls
      // before leaving, or was declared dead (and is fenced).
      conn->close(
          "worker id " + std::to_string(conn->peerId()) +
          " is not a member of the group at epoch " +
          std::to_string(group_.view()->epoch));
      return;
    }
    peer->stats.bytesReceived.fetch_add(
        in->byteSize(), std::memory_order_relaxed);
    peer->stats.callsServed.fetch_add(1, std::memory_order_relaxed);
    ++serverActiveCalls_;
    // Served on this loop thread after the read pass: no hop (see settle).
    auto self = shared_from_this();
    conn->runAfterDispatch(
        [self,
         conn,
         message = std::move(message),
         streams = std::move(streams)]() mutable {
          self->serveRequest(
              std::move(conn), std::move(message), std::move(streams));
        },
        /*expectMore=*/true);
    return;
  }
  size_t remaining = 0;
  auto call = calls_.take(message->id(), &remaining);
  if (!call) {
    // Its caller gave up (timeout) or the id is bogus; nothing to settle.
    lateResponses_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  call->peer->stats.bytesReceived.fetch_add(
      in->byteSize(), std::memory_order_relaxed);
  call->arrival = std::move(streams);
  settle(*conn, std::move(*call), std::move(message), remaining == 0);
}

void Agent::onConnectionClosed(
    transport::Connection& conn,
    const std::string& reason) {
  auto failed = calls_.takeConnection(&conn);
  if (failed.empty()) {
    // A peer's connection we closed because it broke the protocol is worth
    // a line even with no call of ours on it.
    if (!conn.isOutbound() && conn.peerId() >= 0 && !shuttingDown_.load() &&
        conn.rejectedPeer()) {
      logWarning(
          "torch_rpc_ext: " + workerInfo_.name_ + " closed connection " +
          conn.describe() + ": " + reason);
    }
    return;
  }
  if (!shuttingDown_.load()) {
    logWarning(
        "torch_rpc_ext: " + workerInfo_.name_ + " lost connection " +
        conn.describe() + " with " + std::to_string(failed.size()) +
        " calls pending: " + reason);
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

} // namespace torch_rpc_ext
