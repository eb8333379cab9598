// SPDX-License-Identifier: BSD-3-Clause
#pragma once

#include <functional>
#include <memory>
#include <string>

namespace torch_rpc_ext::tracing {

// Trace contexts across the RPC boundary (torch_rpc_ext.tracing, issue 47),
// per thread: no lock, nothing read when tracing is off (empty strings).
//
// Outgoing: what this thread's requests carry from now on (a W3C
// traceparent; "" none). torch_rpc_ext.tracing sets it around the send of
// a call made while a span is current, on the calling thread, where the
// agent's send runs.
void setOutgoing(std::string traceparent);
const std::string& outgoing();

// What the first send of this thread's traced call spent, in the system
// clock's nanoseconds since the epoch (OpenTelemetry's clock), set by
// Agent::send while outgoing() is set and unset since the last take:
// building the frame (the head, the tensors' segments, the device route),
// then handing it to the connection (dialling it first if need be; written,
// or queued for its loop). sendEnd stays 0 for a frame held back (fault
// injection). torch_rpc_ext.tracing takes them after the send for its
// rpc.encode and rpc.send spans.
struct SendPhases {
  int64_t encodeStart = 0;
  int64_t encodeEnd = 0;
  int64_t sendEnd = 0;
};
SendPhases& sendPhases();
// Returns and clears them.
SendPhases takeSendPhases();
int64_t wallNanos();

// When a traced request's CUDA tensors were landed (Agent::onFrame: copies
// into torch's memory enqueued on the arrival streams, allocations made),
// system clock nanoseconds; zeros for a request with none. torch_rpc_ext.
// tracing makes it the server span's rpc.land child.
struct Landing {
  int64_t start = 0;
  int64_t end = 0;
};

// Incoming: the traceparent of the request this thread is serving, while
// its function runs (Server::serve); what the callee's span is a child of.
class Incoming {
 public:
  explicit Incoming(const std::string& traceparent, Landing landing = {});
  ~Incoming();
  Incoming(const Incoming&) = delete;
  Incoming& operator=(const Incoming&) = delete;

 private:
  bool set_;
};
const std::string& incoming();
const Landing& incomingLanding();

// A span the callee makes where no Python runs (builtin operators and
// TorchScript functions): begun by the hook torch_rpc_ext.tracing sets,
// ended once the call's result is known ("" or the error).
class ServeSpan {
 public:
  virtual ~ServeSpan() = default;
  virtual void end(const std::string& error) = 0;
};
using ServeHook = std::function<std::unique_ptr<ServeSpan>(
    const std::string& traceparent,
    const std::string& name)>;
void setServeHook(ServeHook hook);

// The name of the script call this thread decodes to serve (a builtin
// operator's, a TorchScript function's), for its server span: Server::serve
// opens a scope around a traced SCRIPT_CALL, and the decoder says the name
// once it has the call (named()), where the span then begins. The request
// is unpickled once: a second decode, only to name the span, forked its
// RRef arguments twice (a fork deleted as the copy died, or torch's "add
// the same UserRRef twice" assertion).
class ScriptNaming {
 public:
  using Sink = std::function<void(const std::string& name)>;
  explicit ScriptNaming(Sink sink);
  ~ScriptNaming();
  ScriptNaming(const ScriptNaming&) = delete;
  ScriptNaming& operator=(const ScriptNaming&) = delete;
  // Whether a scope on this thread waits for its name.
  static bool wanted();
  // Gives the innermost scope its name (the first one said); else nothing.
  static void named(const std::string& name);

 private:
  Sink sink_;
  ScriptNaming* outer_;
};
// The span for a request served under `traceparent`, or null (no hook).
std::unique_ptr<ServeSpan> beginServe(
    const std::string& traceparent,
    const std::string& name);

} // namespace torch_rpc_ext::tracing
