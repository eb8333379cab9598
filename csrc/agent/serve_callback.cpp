// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/serve_callback.h"

#include "csrc/agent/named_functions.h"
#include "csrc/agent/serving_table.h"
#include "csrc/agent/tracing.h"
#include "csrc/common/logging.h"

#include <torch/csrc/distributed/autograd/rpc_messages/rpc_with_autograd.h>
#include <torch/csrc/distributed/autograd/rpc_messages/rpc_with_profiling_req.h>
#include <torch/csrc/distributed/rpc/profiler/server_process_global_profiler.h>
#include <torch/csrc/distributed/rpc/python_resp.h>
#include <torch/csrc/distributed/rpc/python_rpc_handler.h>
#include <torch/csrc/distributed/rpc/rpc_agent.h>
#include <torch/csrc/distributed/rpc/rref_context.h>
#include <torch/csrc/distributed/rpc/rref_proto.h>
#include <torch/csrc/distributed/rpc/script_remote_call.h>
#include <torch/csrc/distributed/rpc/script_resp.h>
#include <torch/csrc/distributed/rpc/unpickled_python_call.h>
#include <torch/csrc/distributed/rpc/unpickled_python_remote_call.h>
#include <torch/csrc/distributed/rpc/utils.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <optional>

namespace torch_rpc_ext {

namespace rpc = torch::distributed::rpc;
using torch::distributed::autograd::RpcWithAutograd;
using torch::distributed::autograd::RpcWithProfilingReq;

namespace {

// Upstream's wire convention (ScriptCall::toIValues): a builtin call ends
// with [..., schema text, "torch.ops.aten.<name>"], a TorchScript function
// call with [..., is-async flag, qualified name].
constexpr std::string_view kBuiltinPrefix = "torch.ops.aten.";

// A request's work resumed once its RRef arguments are confirmed (on the
// thread that confirmed them, or at once on the serving one): its entry
// among those served (serving_table.h) says running on this thread while
// the work runs, and waiting after if its answer is not ready yet (an
// @async_execution function's). Safe to mark: thenAsync completes the
// future the server waits on only from a callback it adds to the one
// returned here after this returns (or from its catch, if this throws),
// and Server::serve keeps that future whatever fails after the handler
// returned it, so the entry outlives these stores. (With the server-side
// profiler on, upstream's processMessage serves these requests: listed
// waiting until answered.)
template <typename Run>
c10::intrusive_ptr<rpc::JitFuture> resumed(
    const std::optional<ServingTable::Ticket>& ticket,
    Run&& run) {
  if (ticket) {
    ServingTable::enter(*ticket, ServingTable::Stage::kRunning);
  }
  auto future = run();
  if (ticket && !future->completed()) {
    ServingTable::enter(*ticket, ServingTable::Stage::kWaiting);
  }
  return future;
}

// Serving under the streams a request's CUDA tensors arrived on (none: no
// guard), and giving the thread back its current device afterwards, which
// a function may change (torch.cuda.set_device): torch's invokeCallback
// does so around the thenAsync callback these requests used to run in.
class OnArrival {
 public:
  explicit OnArrival(const std::vector<c10::Stream>& streams) {
    if (streams.empty()) {
      return;
    }
    c10::impl::VirtualGuardImpl impl(streams.front().device_type());
    device_.emplace(impl.getDevice());
    streams_.emplace(streams);
  }

 private:
  std::optional<c10::OptionalDeviceGuard> device_; // (restored last)
  std::optional<c10::MultiStreamGuard> streams_;
};

// Upstream's serializePyObject, with the handler given: a value (a
// PyObject holder) pickled under the GIL, a Python error turned into a
// C++ one (its own needs the GIL to be destroyed).
rpc::SerializedPyObj serializeValue(
    rpc::PythonRpcHandler& handler,
    const c10::IValue& value) {
  py::gil_scoped_acquire gil;
  try {
    return handler.serialize(torch::jit::toPyObject(value));
  } catch (py::error_already_set& e) {
    std::runtime_error error(e.what());
    e.restore();
    PyErr_Clear();
    throw error;
  }
}

} // namespace

bool ServeCallback::isNamedFunction(const rpc::ScriptCall& call) {
  return call.hasQualifiedName() &&
      call.qualifiedName().qualifiedName().starts_with(kNamedFunctionPrefix);
}

bool ServeCallback::servedInOneFuture(
    const rpc::RpcCommandBase& call,
    rpc::MessageType type) {
  if (type == rpc::MessageType::PYTHON_CALL) {
    return !static_cast<const rpc::UnpickledPythonCall&>(call)
                .isAsyncExecution();
  }
  if (type == rpc::MessageType::SCRIPT_CALL) {
    const auto& script = static_cast<const rpc::ScriptCall&>(call);
    return script.hasOp() || isNamedFunction(script);
  }
  return false;
}

c10::intrusive_ptr<rpc::JitFuture> ServeCallback::processMessage(
    rpc::Message& request,
    std::vector<c10::Stream> streams) const {
  // With the server-side profiler on, upstream's path records the serving
  // into it; leave that whole case to upstream.
  const rpc::MessageType type = request.type();
  if (type == rpc::MessageType::RREF_USER_DELETE && creations_.any()) {
    if (auto answered = deletionBeforeCreation(request)) {
      return answered;
    }
  }
  // Those that are or may wrap a remote() (for dist autograd, for the
  // legacy profiler), whose fork is being created from their decoding.
  const bool creates = type == rpc::MessageType::PYTHON_REMOTE_CALL ||
      type == rpc::MessageType::SCRIPT_REMOTE_CALL ||
      type == rpc::MessageType::FORWARD_AUTOGRAD_REQ ||
      type == rpc::MessageType::RUN_WITH_PROFILING_REQ;
  if ((type != rpc::MessageType::SCRIPT_CALL &&
       type != rpc::MessageType::PYTHON_CALL && !creates) ||
      rpc::profiler::processglobal::StateStackEntry::current()) {
    return RequestCallbackImpl::processMessage(request, std::move(streams));
  }
  // Upstream's sequence for one request, with our decoding of a script
  // call (a Python UDF is unpickled by upstream's UnpickledPythonCall): RRefs
  // among the arguments must be confirmed before the call runs; errors
  // become an exception response.
  auto& rrefs = rpc::RRefContext::getInstance();
  try {
    rrefs.recordThreadLocalPendingRRefs();
    std::shared_ptr<rpc::RpcCommandBase> call =
        type == rpc::MessageType::SCRIPT_CALL
        ? decodeScriptCall(request)
        : deserializePythonRpcCommand(rpc::deserializeRequest(request), type);
    auto ready = rrefs.waitForThreadLocalPendingRRefs();
    if (creates) {
      // Upstream's sequence exactly; a remote()'s fork is being created
      // from here (while the RRefs among its arguments are confirmed too)
      // until upstream's call returns, having registered it.
      auto fork = createdFork(*call, type);
      if (fork) {
        creations_.begin(fork->first, fork->second);
      }
      try {
        return ready->thenAsync(
            [this,
             call = std::move(call),
             type,
             streams = std::move(streams),
             fork,
             ticket = ServingTable::inHandler()](rpc::JitFuture& /* ready */) {
              return resumed(ticket, [&] {
                return whileCreating(fork, [&] {
                  return processRpcWithErrors(*call, type, streams);
                });
              });
            },
            c10::getCustomClassType<c10::intrusive_ptr<rpc::Message>>());
      } catch (...) {
        if (fork) {
          creationEnded(*fork);
        }
        throw;
      }
    }
    if (ready->completed() && !ready->hasError() &&
        (streams.empty() || servedInOneFuture(*call, type))) {
      // No RRef among the arguments to wait for: run it now. thenAsync
      // would return a future mirroring the one run here, with the same
      // devices (the agent's), its events recorded after this one's (on
      // streams that waited for them): where this one's are recorded on
      // `streams` after the call's work, as ours below are, the mirror
      // orders nothing more. Saves a future, a callback and, with devices,
      // an event and a stream wait per device, a request.
      return processRpcWithErrors(*call, type, streams);
    }
    return ready->thenAsync(
        [this,
         call = std::move(call),
         type,
         streams = std::move(streams),
         ticket = ServingTable::inHandler()](rpc::JitFuture& /* ready */) {
          return resumed(ticket, [&] {
            return processRpcWithErrors(*call, type, streams);
          });
        },
        c10::getCustomClassType<c10::intrusive_ptr<rpc::Message>>());
  } catch (std::exception& e) {
    rrefs.clearRecordedPendingRRefsOnError();
    return asFuture(handleError(e, request.type(), request.id()));
  }
}

std::unique_ptr<rpc::ScriptCall> ServeCallback::decodeScriptCall(
    const rpc::Message& request) const {
  auto call = decodeScriptCallUnnamed(request);
  if (tracing::ScriptNaming::wanted()) {
    tracing::ScriptNaming::named(
        call->hasOp() ? call->op()->schema().name()
                      : call->qualifiedName().qualifiedName());
  }
  return call;
}

std::unique_ptr<rpc::ScriptCall> ServeCallback::decodeScriptCallUnnamed(
    const rpc::Message& request) const {
  const auto& payload = request.payload();
  auto value = torch::jit::unpickle(
      payload.data(),
      payload.size(),
      *rpc::RpcAgent::getCurrentRpcAgent()->getTypeResolver(),
      request.tensors());
  auto ivalues = value.toTupleRef().elements().vec();
  size_t n = ivalues.size();
  if (n < 2 || !ivalues[n - 1].isString()) {
    // Malformed: let upstream decode it and raise its own error.
    return rpc::ScriptCall::fromMessage(request);
  }
  std::string name = ivalues[n - 1].toStringRef();
  if (name.rfind(kBuiltinPrefix, 0) != 0) {
    if (!ivalues[n - 2].isBool()) {
      return rpc::ScriptCall::fromMessage(request);
    }
    bool isAsync = ivalues[n - 2].toBool();
    ivalues.resize(n - 2);
    return std::make_unique<rpc::ScriptCall>(
        c10::QualifiedName(name), std::move(ivalues), isAsync);
  }
  if (!ivalues[n - 2].isString()) {
    return rpc::ScriptCall::fromMessage(request);
  }
  const std::string& schema = ivalues[n - 2].toStringRef();
  std::shared_ptr<torch::jit::Operator> op;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = operators_.find(schema);
    if (it != operators_.end()) {
      op = it->second;
    }
  }
  if (!op) {
    // First sight of this text: upstream resolves it (or throws that no
    // operator matches), and we remember what it found.
    auto call = rpc::ScriptCall::fromMessage(request);
    std::lock_guard<std::mutex> lock(mutex_);
    if (call->hasOp() && operators_.size() < kMaxCachedOperators) {
      operators_.emplace(schema, call->op());
    }
    return call;
  }
  ivalues.resize(n - 2);
  return std::make_unique<rpc::ScriptCall>(std::move(op), std::move(ivalues));
}

c10::intrusive_ptr<rpc::JitFuture> ServeCallback::processScriptCall(
    rpc::RpcCommandBase& rpc,
    const std::vector<c10::Stream>& streams) const {
  auto& call = static_cast<rpc::ScriptCall&>(rpc);
  // Run under the streams the request's CUDA tensors arrived on (none on
  // an agent with no devices, or under upstream's profiling wrapper, which
  // passes none on any agent), as upstream's runJitOperator does: the work
  // is ordered after their landing, and the response's events, recorded on
  // them as asFuture completes it, after the work.
  OnArrival arrival(streams);
  if (isNamedFunction(call)) {
    const NamedFunctions* table = namedFunctions();
    TORCH_INTERNAL_ASSERT(
        table != nullptr, "the scripting layer installs it at load");
    c10::IValue value = table->call(
        call.qualifiedName().qualifiedName().substr(
            kNamedFunctionPrefix.size()),
        call.stackRef());
    return asFuture(rpc::ScriptResp(std::move(value)).toMessage());
  }
  if (call.hasOp()) {
    // A builtin operator: upstream's runJitOperator and the then() after
    // it, without what only they need: the result's static type
    // (TensorType::create allocates a dozen times for a tensor) for an
    // intermediate future, and that future's callback (with devices: its
    // event, and a pool stream per device waiting for it). The same is
    // returned: a future holding the response message (its devices the
    // agent's, its storages' events recorded on the streams the operator
    // ran under, which then() would have waited for before recording its
    // own), or the operator's error. A wrong number of results throws, as
    // upstream's does, to processRpcWithErrors (its "Error on Node" reply).
    auto& stack = call.stackRef();
    try {
      // The sender puts every argument on the stack, defaults too
      // (upstream's matchBuiltinOp): a stack of another size is a crafted
      // request, and the kernel would read below it.
      const auto& schema = call.op()->schema();
      TORCH_CHECK(
          schema.is_vararg() || stack.size() == schema.arguments().size(),
          "builtin operator ",
          schema.operator_name(),
          " takes ",
          schema.arguments().size(),
          " arguments, the request carries ",
          stack.size());
      call.op()->getOperation()(stack);
    } catch (const std::exception&) {
      return asFuture(std::current_exception());
    }
    TORCH_INTERNAL_ASSERT(
        stack.size() == 1,
        "Return value of a builtin operator or a TorchScript function should "
        "be a single IValue, got a vector of size ",
        stack.size());
    try {
      return asFuture(rpc::ScriptResp(std::move(stack.front())).toMessage());
    } catch (const std::exception&) {
      return asFuture(std::current_exception()); // (as upstream's then())
    }
  }
  return RequestCallbackImpl::processScriptCall(rpc, streams);
}

c10::intrusive_ptr<rpc::JitFuture> ServeCallback::processPythonCall(
    rpc::RpcCommandBase& rpc,
    const std::vector<c10::Stream>& streams) const {
  auto& call = static_cast<rpc::UnpickledPythonCall&>(rpc);
  if (call.isAsyncExecution()) {
    // The function runs as upstream runs it (its future, or its error);
    // the answer is made as upstream's then() makes it, with the handler
    // taken here, on a thread without the GIL (serve_callback.h).
    auto& handler = rpc::PythonRpcHandler::getInstance();
    auto future = runPythonFunction(call.pythonUdf(), streams, true);
    return future->then(
        [&handler](rpc::JitFuture& done) {
          return rpc::withStorages(
              rpc::PythonResp(serializeValue(handler, done.value()))
                  .toMessage());
        },
        c10::getCustomClassType<c10::intrusive_ptr<rpc::Message>>());
  }
  // A synchronous function: upstream's runPythonFunction (run under the
  // streams the request's CUDA tensors arrived on and the GIL, the result
  // in a completed future of a PyObject holder) and its then() (the GIL
  // again, the result pickled, the response in a second future), under
  // one hold of the GIL and into one future. The same comes back: the
  // response, its devices the agent's and its storages' events recorded
  // on those streams after the function's work (upstream: the holder's
  // there, found by pickling the result once more, then the second
  // future's on pool streams waiting for them), or the same errors (a
  // Python error escaping torch's _run_function, which turns the
  // function's own exceptions into a RemoteException result; a result
  // that cannot be pickled).
  OnArrival arrival(streams);
  auto& handler = rpc::PythonRpcHandler::getInstance();
  std::optional<rpc::SerializedPyObj> result;
  {
    py::gil_scoped_acquire gil;
    py::object value;
    try {
      value = handler.runPythonUdf(call.pythonUdf());
    } catch (py::error_already_set& e) {
      // (It needs the GIL to be destroyed: restored, then cleared.)
      auto error = std::make_exception_ptr(std::runtime_error(e.what()));
      e.restore();
      PyErr_Clear();
      return asFuture(error);
    } catch (const std::exception&) {
      return asFuture(std::current_exception());
    }
    try {
      try {
        result.emplace(handler.serialize(value));
      } catch (py::error_already_set& e) {
        std::string message = e.what();
        e.restore();
        PyErr_Clear();
        TORCH_CHECK(false, message); // (upstream's serializePyObject)
      }
    } catch (const std::exception&) {
      return asFuture(std::current_exception()); // (as upstream's then())
    }
  }
  return asFuture(rpc::PythonResp(std::move(*result)).toMessage());
}

c10::intrusive_ptr<rpc::JitFuture> ServeCallback::processPythonRRefFetchCall(
    rpc::RpcCommandBase& rpc) const {
  auto& fetch = static_cast<rpc::PythonRRefFetchCall&>(rpc);
  auto& handler = rpc::PythonRpcHandler::getInstance();
  auto future = retrieveOwnerRRef(fetch.rrefId());
  return future->then(
      [&handler](rpc::JitFuture& done) {
        return rpc::withStorages(
            rpc::PythonRRefFetchRet(
                serializeValue(handler, done.value()).toIValues())
                .toMessage());
      },
      c10::getCustomClassType<c10::intrusive_ptr<rpc::Message>>());
}

std::optional<ServeCallback::Fork> ServeCallback::createdFork(
    rpc::RpcCommandBase& call,
    rpc::MessageType type) {
  rpc::RpcCommandBase* command = &call;
  // (Profiling wraps what dist autograd wrapped.)
  for (int depth = 0; depth < 2; ++depth) {
    if (type == rpc::MessageType::FORWARD_AUTOGRAD_REQ) {
      auto& wrapped = static_cast<RpcWithAutograd&>(*command);
      type = wrapped.wrappedMessageType();
      command = &wrapped.wrappedRpc();
    } else if (type == rpc::MessageType::RUN_WITH_PROFILING_REQ) {
      auto& wrapped = static_cast<RpcWithProfilingReq&>(*command);
      type = wrapped.wrappedMessageType();
      command = &wrapped.wrappedRpc();
    }
  }
  std::optional<Fork> fork;
  if (type == rpc::MessageType::PYTHON_REMOTE_CALL) {
    // (Unpickled by deserializePythonRpcCommand, wrapped or not.)
    const auto& remote =
        static_cast<const rpc::UnpickledPythonRemoteCall&>(*command);
    fork.emplace(remote.rrefId(), remote.forkId());
  } else if (type == rpc::MessageType::SCRIPT_REMOTE_CALL) {
    const auto& remote = static_cast<const rpc::ScriptRemoteCall&>(*command);
    fork.emplace(remote.retRRefId(), remote.retForkId());
  }
  if (fork && fork->first == fork->second) {
    fork.reset();
  }
  return fork;
}

c10::intrusive_ptr<rpc::JitFuture> ServeCallback::whileCreating(
    const std::optional<Fork>& fork,
    const std::function<c10::intrusive_ptr<rpc::JitFuture>()>& serve) const {
  struct Ended {
    const ServeCallback& callback;
    const std::optional<Fork>& fork;
    ~Ended() {
      if (fork) {
        callback.creationEnded(*fork);
      }
    }
  } ended{*this, fork};
  return serve();
}

void ServeCallback::creationEnded(const Fork& fork) const {
  try {
    if (!creations_.end(fork.second)) {
      return;
    }
    // As torch serves a RRefUserDelete (processRRefUserDelete).
    auto deleted =
        rpc::RRefContext::getInstance().delForkOfOwner(fork.first, fork.second);
    handleRRefDelete(deleted);
  } catch (const std::exception& e) {
    logWarning(
        c10::str(
            "torch_rpc_ext: applying a deletion of fork ",
            fork.second,
            " that arrived before its creation: ",
            e.what()));
  }
}

c10::intrusive_ptr<rpc::JitFuture> ServeCallback::deletionBeforeCreation(
    const rpc::Message& request) const {
  std::unique_ptr<rpc::RRefUserDelete> deletion;
  try {
    deletion = rpc::RRefUserDelete::fromMessage(request);
  } catch (const std::exception&) {
    return {}; // (upstream's path refuses it in its own words)
  }
  if (!creations_.deferDeletion(deletion->rrefId(), deletion->forkId())) {
    return {};
  }
  return asFuture(rpc::RRefAck().toMessage());
}

c10::intrusive_ptr<rpc::JitFuture> ServeCallback::processRemoteCall(
    rpc::RpcCommandBase& rpc,
    const std::vector<c10::Stream>& streams,
    rpc::MessageType type) const {
  // The fork is registered once upstream's call returns (assignOwnerRRef).
  auto fork = createdFork(rpc, type);
  if (fork) {
    creations_.begin(fork->first, fork->second);
  }
  return whileCreating(fork, [&] {
    return type == rpc::MessageType::PYTHON_REMOTE_CALL
        ? RequestCallbackImpl::processPythonRemoteCall(rpc, streams)
        : RequestCallbackImpl::processScriptRemoteCall(rpc, streams);
  });
}

c10::intrusive_ptr<rpc::JitFuture> ServeCallback::processPythonRemoteCall(
    rpc::RpcCommandBase& rpc,
    const std::vector<c10::Stream>& streams) const {
  return processRemoteCall(rpc, streams, rpc::MessageType::PYTHON_REMOTE_CALL);
}

c10::intrusive_ptr<rpc::JitFuture> ServeCallback::processScriptRemoteCall(
    rpc::RpcCommandBase& rpc,
    const std::vector<c10::Stream>& streams) const {
  return processRemoteCall(rpc, streams, rpc::MessageType::SCRIPT_REMOTE_CALL);
}

size_t ServeCallback::cachedOperators() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return operators_.size();
}

namespace {
std::atomic<const NamedFunctions*> gNamedFunctions{nullptr};
} // namespace

void installNamedFunctions(const NamedFunctions* table) {
  gNamedFunctions.store(table, std::memory_order_release);
}

const NamedFunctions* namedFunctions() {
  return gNamedFunctions.load(std::memory_order_acquire);
}

} // namespace torch_rpc_ext
