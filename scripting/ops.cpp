// SPDX-License-Identifier: BSD-3-Clause
// The operators callers use to reach registered remote functions, from eager
// Python (torch.ops.torch_rpc_ext.*, or torch_rpc_ext.scripting's wrappers),
// from TorchScript (scripted code, and modules saved with torch.jit.save and
// loaded without any Python source) and from torch.compile (through
// torch_rpc_ext.scripting's custom op, which calls rpc_sync).
//
// A call is an ordinary SCRIPT_CALL naming kNamedFunctionPrefix + name: it
// goes through upstream's rpcTorchscript, so dist autograd, timeouts,
// profiling and error responses are exactly TorchScript RPC's.
//
// The schemas are CONSERVATIVE for alias analysis: TorchScript then treats a
// call as having side effects, so one whose value is unused is neither
// eliminated nor moved across other side effects.
#include <torch/csrc/distributed/rpc/rpc_agent.h>
#include <torch/csrc/distributed/rpc/torchscript_functions.h>
#include <torch/library.h>

#include <charconv>
#include <map>

#include "csrc/agent/agent.h"
#include "scripting/registry.h"

namespace torch_rpc_ext::scripting {

namespace {

namespace rpc = torch::distributed::rpc;

c10::intrusive_ptr<c10::ivalue::Future> callAsync(
    const std::string& to,
    const std::string& name,
    const c10::IValue& args,
    double timeout) {
  checkName(name);
  TORCH_CHECK_TYPE(
      args.isNone() || args.isTuple(),
      "remote function '",
      name,
      "' on ",
      to,
      ": args must be a tuple of the call's positional arguments, got ",
      args.tagKind());
  TORCH_CHECK(
      rpc::RpcAgent::isCurrentRpcAgentSet(),
      "remote function '",
      name,
      "' on ",
      to,
      ": RPC is not initialized in this process (call rpc.init_rpc with "
      "backend=rpc.BackendType.TORCH_RPC_EXT first)");
  auto agent = rpc::RpcAgent::getCurrentRpcAgent();
  TORCH_CHECK(
      dynamic_cast<Agent*>(agent.get()) != nullptr,
      "remote function '",
      name,
      "' on ",
      to,
      ": remote functions need the TORCH_RPC_EXT backend, and this process "
      "runs another RPC backend");
  // The value's type is known only on the callee: the future holds Any.
  static const c10::FunctionSchema kReturnsAny(
      "", "", {}, {c10::Argument("", c10::AnyType::get())});
  std::vector<c10::IValue> stack;
  if (args.isTuple()) {
    stack = args.toTupleRef().elements().vec();
  }
  return rpc::rpcTorchscript(
      to,
      c10::QualifiedName(std::string(kNamedFunctionPrefix) + name),
      kReturnsAny,
      std::move(stack),
      static_cast<float>(timeout));
}

void rpcAsyncKernel(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  double timeout = torch::jit::pop(*stack).toDouble();
  c10::IValue args = torch::jit::pop(*stack);
  std::string name = torch::jit::pop(*stack).toStringRef();
  std::string to = torch::jit::pop(*stack).toStringRef();
  torch::jit::push(*stack, callAsync(to, name, args, timeout));
}

void rpcSyncKernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  rpcAsyncKernel(op, stack);
  auto future = torch::jit::pop(*stack).toFuture();
  future->waitAndThrow();
  torch::jit::push(*stack, future->value());
}

// Where a compiled call's outputs are (its fake says the same, in
// torch_rpc_ext.scripting): the CUDA device of its CUDA arguments, else the
// CPU. Arguments on two CUDA devices are refused.
c10::Device callDevice(
    const std::string& name,
    const std::string& to,
    at::TensorList args) {
  c10::Device home(c10::kCPU);
  for (const auto& a : args) {
    if (a.device().is_cpu()) {
      continue;
    }
    TORCH_CHECK(
        home.is_cpu() || home == a.device(),
        "remote function '",
        name,
        "' on ",
        to,
        ": a call from torch.compile takes tensors of one device (and the "
        "CPU), got ",
        home.str(),
        " and ",
        a.device().str());
    home = a.device();
  }
  return home;
}

// "dtype[d0, d1]", as the errors below name what a call returned.
std::string described(const std::string& dtype, c10::IntArrayRef shape) {
  return dtype + c10::str(shape);
}

// The real outputs against `outputs` ("count|dtype:d0,d1|...", the fake's
// answer when the call was compiled, torch_rpc_ext.scripting): compiled
// code reads them with those sizes and dtypes (an inductor kernel indexes
// them as such), so a function the owner replaced since, or one that
// returns other than its fake said, fails here naming both rather than
// having its memory read as what it is not. Empty: the operator called
// directly, not compiled, nothing to hold it to.
void checkCompiledOutputs(
    const std::string& name,
    const std::string& to,
    const std::string& outputs,
    const std::vector<at::Tensor>& out) {
  if (outputs.empty()) {
    return;
  }
  std::vector<std::string> fields;
  for (size_t start = 0;;) {
    size_t end = outputs.find('|', start);
    fields.push_back(outputs.substr(start, end - start));
    if (end == std::string::npos) {
      break;
    }
    start = end + 1;
  }
  size_t count = 0;
  const std::string& first = fields.front();
  auto [ptr, ec] =
      std::from_chars(first.data(), first.data() + first.size(), count);
  TORCH_CHECK_VALUE(
      ec == std::errc() && ptr == first.data() + first.size() &&
          count + 1 == fields.size(),
      "malformed compiled-call outputs '",
      outputs,
      "'");
  const char* again =
      ": the function changed since the call was compiled, or returns other "
      "than its fake says (torch._dynamo.reset() compiles anew)";
  TORCH_CHECK(
      out.size() == count,
      "remote function '",
      name,
      "' on ",
      to,
      " returned ",
      out.size(),
      " tensors where the call was compiled for ",
      count,
      again);
  for (size_t i = 0; i < count; ++i) {
    const std::string& entry = fields[i + 1];
    const std::string got = described(
        std::string(c10::getDtypeNames(out[i].scalar_type()).first),
        out[i].sizes());
    // The expected entry in the same form: "float32:4,3" -> "float32[4, 3]".
    size_t colon = entry.find(':');
    TORCH_CHECK_VALUE(
        colon != std::string::npos,
        "malformed compiled-call outputs '",
        outputs,
        "'");
    std::vector<int64_t> dims;
    for (size_t start = colon + 1; start < entry.size();) {
      size_t end = entry.find(',', start);
      end = end == std::string::npos ? entry.size() : end;
      int64_t d = 0;
      auto [p, e] =
          std::from_chars(entry.data() + start, entry.data() + end, d);
      TORCH_CHECK_VALUE(
          e == std::errc() && p == entry.data() + end,
          "malformed compiled-call outputs '",
          outputs,
          "'");
      dims.push_back(d);
      start = end + 1;
    }
    const std::string expected = described(entry.substr(0, colon), dims);
    TORCH_CHECK(
        got == expected,
        "remote function '",
        name,
        "' on ",
        to,
        " returned value ",
        i,
        " as ",
        got,
        " where the call was compiled for ",
        expected,
        again);
  }
}

// torch.compile's op: tensors (and compile-time constants) in, tensors out:
// what fake tensors and functionalization can see through. Its fake
// implementation and its ordering effect are registered from Python
// (torch_rpc_ext.scripting).
std::vector<at::Tensor> callTensors(
    const std::string& to,
    const std::string& name,
    at::TensorList args,
    const std::string& constants,
    double timeout,
    const std::string& outputs) {
  const c10::Device home = callDevice(name, to, args);
  std::vector<c10::IValue> elements = compiledArguments(args, constants);
  auto future = callAsync(
      to, name, c10::ivalue::Tuple::create(std::move(elements)), timeout);
  future->waitAndThrow();
  const c10::IValue& value = future->value();
  std::vector<at::Tensor> out;
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTuple() || value.isList()) {
    auto elems = value.isTuple() ? value.toTupleRef().elements().vec()
                                 : value.toListRef().vec();
    for (const auto& e : elems) {
      TORCH_CHECK_TYPE(
          e.isTensor(),
          "remote function '",
          name,
          "' on ",
          to,
          " returned a ",
          e.tagKind(),
          " among its values: a call from torch.compile returns tensors only");
      out.push_back(e.toTensor());
    }
  } else {
    TORCH_CHECK_TYPE(
        false,
        "remote function '",
        name,
        "' on ",
        to,
        " returned a ",
        value.tagKind(),
        ": a call from torch.compile returns a tensor or a tuple of tensors");
  }
  checkCompiledOutputs(name, to, outputs, out);
  // The fake put every output on the call's device: one that arrived
  // elsewhere would have the compiled code read it as memory it is not.
  for (size_t i = 0; i < out.size(); ++i) {
    TORCH_CHECK(
        out[i].device() == home,
        "remote function '",
        name,
        "' on ",
        to,
        " returned value ",
        i,
        " on ",
        out[i].device().str(),
        ": a call from torch.compile returns its tensors on the device of its "
        "tensor arguments (",
        home.str(),
        "), as compiled code expects them");
  }
  // An operator's outputs must alias neither its inputs nor each other: a
  // tensor a callee on this host returns unchanged comes back as a view of
  // the caller's own storage (shared slabs), and one returned twice comes
  // back once (the pickle's memo). Outputs are contiguous, as the fake
  // promises.
  for (size_t i = 0; i < out.size(); ++i) {
    bool aliases = false;
    for (const auto& a : args) {
      aliases = aliases || out[i].is_alias_of(a);
    }
    for (size_t j = 0; j < i; ++j) {
      aliases = aliases || out[i].is_alias_of(out[j]);
    }
    out[i] = aliases ? out[i].clone(at::MemoryFormat::Contiguous)
                     : out[i].contiguous();
  }
  return out;
}

} // namespace

std::vector<c10::IValue> compiledArguments(
    at::TensorList tensors,
    const std::string& constants) {
  std::map<size_t, c10::IValue> fixed;
  for (size_t start = 0; start < constants.size();) {
    size_t end = constants.find('\x1f', start);
    end = end == std::string::npos ? constants.size() : end;
    const std::string entry = constants.substr(start, end - start);
    start = end + 1;
    auto bad = [&entry](const char* why) {
      TORCH_CHECK_VALUE(
          false, "malformed compiled-call constant '", entry, "': ", why);
    };
    // Whole-field parses only: "12abc" is not 12.
    auto whole = [](const std::string& text, auto& out) {
      const char* last = text.data() + text.size();
      auto [ptr, ec] = std::from_chars(text.data(), last, out);
      return ec == std::errc() && ptr == last;
    };
    size_t eq = entry.find('=');
    size_t at = 0;
    if (eq == std::string::npos || eq + 1 >= entry.size() ||
        !whole(entry.substr(0, eq), at)) {
      bad("expected <position>=<tag><value>");
    }
    const char tag = entry[eq + 1];
    const std::string value = entry.substr(eq + 2);
    c10::IValue parsed;
    if (tag == 'n' && value.empty()) {
      parsed = c10::IValue();
    } else if (tag == 'b' && (value == "0" || value == "1")) {
      parsed = value == "1";
    } else if (tag == 'i') {
      int64_t i = 0;
      if (!whole(value, i)) {
        bad("not a 64-bit integer");
      }
      parsed = i;
    } else if (tag == 'f') {
      double f = 0;
      if (!whole(value, f)) {
        bad("not a float");
      }
      parsed = f;
    } else if (tag == 's') {
      parsed = value;
    } else {
      bad("unknown tag or value");
    }
    TORCH_CHECK_VALUE(
        fixed.emplace(at, std::move(parsed)).second,
        "malformed compiled-call constants: position ",
        at,
        " given twice");
  }
  std::vector<c10::IValue> out;
  size_t next = 0;
  for (size_t i = 0; i < tensors.size() + fixed.size(); ++i) {
    auto it = fixed.find(i);
    if (it != fixed.end()) {
      out.push_back(std::move(it->second));
    } else {
      TORCH_CHECK_VALUE(
          next < tensors.size(), "compiled-call constants out of range");
      out.emplace_back(tensors[next++]);
    }
  }
  return out;
}

TORCH_LIBRARY(torch_rpc_ext, m) {
  // Where the fake implementation of call_tensors lives (torch imports it
  // on demand under fake tensors).
  m.set_python_module("torch_rpc_ext.scripting");
  // `args`: a tuple of positional arguments (TorchScript accepts a tuple
  // literal of mixed types for Any; a list must hold one type). `timeout` in
  // seconds; -1: the agent's rpc_timeout, 0: none.
  m.def(
      torch::schema(
          "torch_rpc_ext::rpc_async(str to, str name, Any? args=None, float "
          "timeout=-1.) -> Future(Any)",
          c10::AliasAnalysisKind::CONSERVATIVE));
  m.def(
      torch::schema(
          "torch_rpc_ext::rpc_sync(str to, str name, Any? args=None, float "
          "timeout=-1.) -> Any",
          c10::AliasAnalysisKind::CONSERVATIVE));
  m.def(
      torch::schema(
          "torch_rpc_ext::call_tensors(str to, str name, Tensor[] args, str "
          "constants=\"\", float timeout=-1., str outputs=\"\") -> Tensor[]",
          c10::AliasAnalysisKind::CONSERVATIVE));
}

// No tensor among the arguments the dispatcher looks at: one kernel for
// every dispatch key.
TORCH_LIBRARY_IMPL(torch_rpc_ext, CatchAll, m) {
  m.impl(
      "rpc_async",
      torch::CppFunction::makeFromBoxedFunction<&rpcAsyncKernel>());
  m.impl(
      "rpc_sync", torch::CppFunction::makeFromBoxedFunction<&rpcSyncKernel>());
}

// Dispatched on its tensors (an empty list reaches this kernel too); the
// fake kernel comes from Python.
TORCH_LIBRARY_IMPL(torch_rpc_ext, CompositeExplicitAutograd, m) {
  m.impl("call_tensors", TORCH_FN(callTensors));
}

} // namespace torch_rpc_ext::scripting
