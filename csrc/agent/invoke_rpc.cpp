// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/invoke_rpc.h"

#include "csrc/agent/agent.h"
#include "csrc/agent/builtin_call.h"

#include <torch/csrc/distributed/autograd/utils.h>
#include <torch/csrc/distributed/rpc/python_call.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <optional>

namespace torch_rpc_ext::invoke_rpc {

namespace {

namespace rpc = torch::distributed::rpc;
using JitFuture = c10::ivalue::Future;

// torch's Python objects the steps use, looked up once (under the GIL, at
// the first call: torch.distributed.rpc is imported by then). Never
// destroyed: they must not be released after the interpreter.
struct Torchs {
  py::object fallback; // what `api._invoke_rpc` was
  py::object findBuiltin; // torch.jit._builtins._find_builtin
  py::object toWorkerInfo; // api._to_worker_info
  py::object profilerEnabled; // torch.autograd._profiler_enabled
  py::object scriptFunction; // torch.jit.ScriptFunction
  py::object qualifiedName; // torch._jit_internal._qualified_name
  py::object invokeTorchscript; // api._invoke_rpc_torchscript
  py::object pickler; // api._default_pickler
  py::object pythonUdf; // api.PythonUDF
  py::str asyncAttr{"_wrapped_async_rpc_function"};
  bool resolved = false;

  void resolve() {
    if (resolved) {
      return;
    }
    auto api = py::module_::import("torch.distributed.rpc.api");
    findBuiltin =
        py::module_::import("torch.jit._builtins").attr("_find_builtin");
    toWorkerInfo = api.attr("_to_worker_info");
    profilerEnabled =
        py::module_::import("torch.autograd").attr("_profiler_enabled");
    scriptFunction = py::module_::import("torch.jit").attr("ScriptFunction");
    qualifiedName =
        py::module_::import("torch._jit_internal").attr("_qualified_name");
    invokeTorchscript = api.attr("_invoke_rpc_torchscript");
    pickler = api.attr("_default_pickler");
    pythonUdf = api.attr("PythonUDF");
    resolved = true;
  }
};

Torchs& torchs() {
  static auto* t = new Torchs();
  return *t;
}

// torch's pyRpcPythonUdf: the pickled call in a PYTHON_CALL message, sent
// with distributed autograd's wrapping (grad recording forced, as torch's),
// its response converted to the Python object.
c10::intrusive_ptr<JitFuture> sendPythonUdf(
    const rpc::WorkerInfo& dst,
    std::string pickled,
    std::vector<at::Tensor> tensors,
    float rpcTimeoutSeconds,
    bool isAsyncExecution) {
  rpc::SerializedPyObj call(std::move(pickled), std::move(tensors));
  auto message = rpc::PythonCall(std::move(call), isAsyncExecution).toMessage();
  auto agent = rpc::RpcAgent::getCurrentRpcAgent();
  return builtin_call::toPyFuture(
      torch::distributed::autograd::sendMessageWithAutograd(
          *agent, dst, std::move(message), true, rpcTimeoutSeconds));
}

py::object asPython(c10::intrusive_ptr<JitFuture> future) {
  return torch::jit::toPyObject(c10::IValue(std::move(future)));
}

} // namespace

void setFallback(py::object fn) {
  torchs().fallback = std::move(fn);
}

py::object invoke(
    const py::object& to,
    const py::object& func,
    const py::object& rpcType,
    py::object args,
    py::object kwargs,
    float rpcTimeoutSeconds) {
  Torchs& t = torchs();
  t.resolve();
  std::shared_ptr<rpc::RpcAgent> current;
  if (rpc::RpcAgent::isCurrentRpcAgentSet()) {
    current = rpc::RpcAgent::getCurrentRpcAgent();
  }
  Agent* agent = dynamic_cast<Agent*>(current.get());
  // Another backend's agent, or the legacy profiler's RPC events to record
  // (torch's `_get_should_profile()` is that and more): torch's steps.
  if (agent == nullptr || t.profilerEnabled().cast<bool>()) {
    TORCH_CHECK(
        t.fallback,
        "torch_rpc_ext: _invoke_rpc called with no function to fall back to");
    return t.fallback(to, func, rpcType, args, kwargs, rpcTimeoutSeconds);
  }
  if (!PyCallable_Check(func.ptr())) {
    throw py::type_error("function should be callable.");
  }
  py::object builtin = t.findBuiltin(func);
  // torch's _to_worker_info: a WorkerInfo as it is, a name asked of the
  // agent (the same call torch's get_worker_info makes), anything else
  // (a rank, or what it refuses) through torch's own.
  py::object resolved;
  std::optional<rpc::WorkerInfo> named; // (a copy: the view may change)
  const rpc::WorkerInfo* dst = nullptr;
  if (py::isinstance<rpc::WorkerInfo>(to)) {
    dst = &to.cast<const rpc::WorkerInfo&>();
  } else if (PyUnicode_Check(to.ptr())) {
    dst = &named.emplace(agent->getWorkerInfo(to.cast<std::string>()));
  } else {
    resolved = t.toWorkerInfo(to);
    dst = &resolved.cast<const rpc::WorkerInfo&>();
  }
  if (!PyObject_IsTrue(args.ptr())) {
    args = py::tuple();
  }
  if (!PyObject_IsTrue(kwargs.ptr())) {
    kwargs = py::dict();
  }
  py::object fn = func;
  bool isAsyncExecution = py::hasattr(func, t.asyncAttr);
  if (isAsyncExecution) {
    py::object wrapped = func.attr(t.asyncAttr);
    if (py::isinstance(wrapped, t.scriptFunction)) {
      fn = std::move(wrapped);
    }
  }
  if (!builtin.is_none()) {
    // (torch's `_invoke_rpc_builtin(dst, name, timeout, *args, **kwargs)`.)
    py::tuple positional(args);
    py::dict named = py::isinstance<py::dict>(kwargs)
        ? py::reinterpret_borrow<py::dict>(kwargs)
        : py::dict(kwargs);
    return asPython(
        builtin_call::send(
            *dst,
            builtin.cast<std::string>(),
            py::reinterpret_borrow<py::args>(positional),
            py::reinterpret_borrow<py::kwargs>(named),
            rpcTimeoutSeconds));
  }
  if (py::isinstance(fn, t.scriptFunction)) {
    return t.invokeTorchscript(
        dst->name_,
        t.qualifiedName(fn),
        args,
        kwargs,
        rpcTimeoutSeconds,
        isAsyncExecution);
  }
  py::tuple pickled =
      t.pickler.attr("serialize")(t.pythonUdf(fn, args, kwargs));
  auto payload = pickled[0].cast<std::string>();
  auto tensors = pickled[1].cast<std::vector<at::Tensor>>();
  c10::intrusive_ptr<JitFuture> future;
  {
    py::gil_scoped_release release;
    future = sendPythonUdf(
        *dst,
        std::move(payload),
        std::move(tensors),
        rpcTimeoutSeconds,
        isAsyncExecution);
  }
  return asPython(std::move(future));
}

} // namespace torch_rpc_ext::invoke_rpc
