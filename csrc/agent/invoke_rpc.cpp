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

// torch's Python objects the steps use. Module globals torch's
// `_invoke_rpc` reads on every call (`_default_pickler`, which
// `api._use_rpc_pickler` swaps for a block; the functions it calls, which
// another library may patch) are read from the module's dict on every call
// here too; the rest are looked up once (under the GIL, at the first call:
// torch.distributed.rpc is imported by then). Never destroyed: they must
// not be released after the interpreter.
struct Torchs {
  py::object fallback; // what `api._invoke_rpc` was
  py::dict api; // torch.distributed.rpc.api's globals
  py::dict builtins; // torch.jit._builtins's globals (`_find_builtin`)
  py::object profilerEnabled; // torch.autograd._profiler_enabled
  py::object scriptFunction; // torch.jit.ScriptFunction
  py::object qualifiedName; // torch._jit_internal._qualified_name
  py::object torchsPythonUdf; // torch's binding `_invoke_rpc_python_udf`
  py::object ourBuiltin; // our `_C._invoke_rpc_builtin`, once installed
  py::str asyncAttr{"_wrapped_async_rpc_function"};
  bool resolved = false;

  void resolve() {
    if (resolved) {
      return;
    }
    api = py::module_::import("torch.distributed.rpc.api").attr("__dict__");
    builtins = py::module_::import("torch.jit._builtins").attr("__dict__");
    profilerEnabled =
        py::module_::import("torch.autograd").attr("_profiler_enabled");
    scriptFunction = py::module_::import("torch.jit").attr("ScriptFunction");
    qualifiedName =
        py::module_::import("torch._jit_internal").attr("_qualified_name");
    torchsPythonUdf = py::module_::import("torch._C._distributed_rpc")
                          .attr("_invoke_rpc_python_udf");
    ourBuiltin =
        py::module_::import("torch_rpc_ext._C").attr("_invoke_rpc_builtin");
    resolved = true;
  }

  // A module global as the module has it now.
  static py::object global(const py::dict& dict, const char* name) {
    PyObject* value = PyDict_GetItemString(dict.ptr(), name); // borrowed
    if (value == nullptr) {
      throw py::attribute_error(name);
    }
    return py::reinterpret_borrow<py::object>(value);
  }
};

// Python's `hasattr`: an AttributeError is false (without making one, for
// the usual objects), any other error raises.
bool hasAttribute(const py::handle& object, const py::str& name) {
  PyObject* value = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  int found = PyObject_GetOptionalAttr(object.ptr(), name.ptr(), &value);
#else
  int found = _PyObject_LookupAttr(object.ptr(), name.ptr(), &value);
#endif
  if (found < 0) {
    throw py::error_already_set();
  }
  Py_XDECREF(value);
  return found == 1;
}

// The destination as a Python WorkerInfo, for a function of torch's (or a
// patch of one) that takes it: the caller's, torch's `_to_worker_info`'s,
// or the agent's, copied.
py::object destination(
    const py::object& to,
    const py::object& resolved,
    const rpc::WorkerInfo& dst) {
  if (py::isinstance<rpc::WorkerInfo>(to)) {
    return to;
  }
  return resolved ? resolved : py::cast(dst);
}

// Python's truth of `value` (`args if args else ()`), raising as it does.
bool truth(const py::handle& value) {
  int b = PyObject_IsTrue(value.ptr());
  if (b < 0) {
    throw py::error_already_set();
  }
  return b == 1;
}

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
  // torch's steps (its function) for: another backend's agent; the legacy
  // profiler's RPC events to record (torch's `_get_should_profile()` is
  // that and more); arguments in forms other than a tuple or list and a
  // dict (torch's `*args` / `**kwargs` word their refusals).
  bool usual = (args.is_none() || PyTuple_Check(args.ptr()) ||
                PyList_Check(args.ptr())) &&
      (kwargs.is_none() || PyDict_Check(kwargs.ptr()));
  if (usual && !kwargs.is_none()) {
    for (auto item : py::reinterpret_borrow<py::dict>(kwargs)) {
      usual = usual && PyUnicode_Check(item.first.ptr());
    }
  }
  if (agent == nullptr || !usual || t.profilerEnabled().cast<bool>()) {
    TORCH_CHECK(
        t.fallback,
        "torch_rpc_ext: _invoke_rpc called with no function to fall back to");
    return t.fallback(to, func, rpcType, args, kwargs, rpcTimeoutSeconds);
  }
  if (!PyCallable_Check(func.ptr())) {
    throw py::type_error("function should be callable.");
  }
  py::object builtin = Torchs::global(t.builtins, "_find_builtin")(func);
  // torch's _to_worker_info: a WorkerInfo as it is, a name asked of the
  // agent (the same call torch's get_worker_info makes), anything else
  // (a rank, or what it refuses) through torch's own.
  py::object resolved;
  std::optional<rpc::WorkerInfo> byName; // (a copy: the view may change)
  const rpc::WorkerInfo* dst = nullptr;
  if (py::isinstance<rpc::WorkerInfo>(to)) {
    dst = &to.cast<const rpc::WorkerInfo&>();
  } else if (PyUnicode_Check(to.ptr())) {
    dst = &byName.emplace(agent->getWorkerInfo(to.cast<std::string>()));
  } else {
    resolved = Torchs::global(t.api, "_to_worker_info")(to);
    dst = &resolved.cast<const rpc::WorkerInfo&>();
  }
  if (!truth(args)) {
    args = py::tuple();
  }
  if (!truth(kwargs)) {
    kwargs = py::dict();
  }
  py::object fn = func;
  bool isAsyncExecution = hasAttribute(func, t.asyncAttr);
  if (isAsyncExecution) {
    py::object wrapped = func.attr(t.asyncAttr);
    if (py::isinstance(wrapped, t.scriptFunction)) {
      fn = std::move(wrapped);
    }
  }
  if (!builtin.is_none()) {
    // torch's `_invoke_rpc_builtin(dst, name, timeout, *args, **kwargs)`,
    // through the module's global: ours called directly, another's (a
    // patch) as torch would call it.
    py::object frontend = Torchs::global(t.api, "_invoke_rpc_builtin");
    py::tuple positional(args);
    auto named = py::reinterpret_borrow<py::dict>(kwargs);
    if (!frontend.is(t.ourBuiltin)) {
      return frontend(
          destination(to, resolved, *dst),
          builtin,
          rpcTimeoutSeconds,
          *positional,
          **named);
    }
    return asPython(
        builtin_call::send(
            *dst,
            builtin.cast<std::string>(),
            py::reinterpret_borrow<py::args>(positional),
            py::reinterpret_borrow<py::kwargs>(named),
            rpcTimeoutSeconds));
  }
  if (py::isinstance(fn, t.scriptFunction)) {
    return Torchs::global(t.api, "_invoke_rpc_torchscript")(
        dst->name_,
        t.qualifiedName(fn),
        args,
        kwargs,
        rpcTimeoutSeconds,
        isAsyncExecution);
  }
  py::object udf = Torchs::global(t.api, "PythonUDF")(fn, args, kwargs);
  py::tuple pickled =
      Torchs::global(t.api, "_default_pickler").attr("serialize")(udf);
  py::object frontend = Torchs::global(t.api, "_invoke_rpc_python_udf");
  if (!frontend.is(t.torchsPythonUdf)) {
    return frontend(
        destination(to, resolved, *dst),
        pickled[0],
        pickled[1],
        rpcTimeoutSeconds,
        isAsyncExecution);
  }
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
