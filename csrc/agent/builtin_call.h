// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// The caller's half of a builtin call (rpc_sync / rpc_async of a torch
// operator), in place of torch's `_invoke_rpc_builtin` (pyRpcBuiltin).
//
// torch's frontend matches the operator to the arguments, makes a
// ScriptCall and pickles it with the operator's whole schema, printed anew
// on every call (`toString(schema)`, ~2 us here, a fifth of the call's
// frontend), then wraps the call's future in one that converts the
// response to a Python object. This does the same steps with torch's own
// functions, except that the two texts the message carries for an operator
// (its schema and its `torch.ops.aten.` name) are made once per operator
// and kept. The message's bytes are the ones torch makes
// (tests/rpc/test_builtin_call.py compares them), so a peer on torch's
// frontend or ours reads it the same.

#include <torch/csrc/distributed/rpc/message.h>
#include <torch/csrc/distributed/rpc/rpc_agent.h>
#include <torch/csrc/jit/runtime/operator.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>

namespace torch_rpc_ext::builtin_call {

namespace py = pybind11;
namespace rpc = torch::distributed::rpc;

// The message torch's `ScriptCall(op, stack).toMessage()` makes, without
// printing the schema.
c10::intrusive_ptr<rpc::Message> requestMessage(
    const std::shared_ptr<torch::jit::Operator>& op,
    std::vector<c10::IValue> stack);

// torch's pyRpcBuiltin: match `opName` (an `aten::` name, from
// torch.jit._builtins) to the arguments, send the call to `dst` through the
// current agent (distributed autograd and the legacy profiler's wrapping as
// torch does: sendMessageWithAutograd), and return the future of the
// response as a Python object. Called with the GIL held; lets it go while
// sending.
c10::intrusive_ptr<c10::ivalue::Future> send(
    const rpc::WorkerInfo& dst,
    const std::string& opName,
    const py::args& args,
    const py::kwargs& kwargs,
    float rpcTimeoutSeconds);

// torch's toPyJitFuture (hasValue): the future of `messageFuture`'s response
// (a builtin call's SCRIPT_RET or a Python UDF's PYTHON_RET) as a Python
// object, or its error, converted under the caller's thread-local state.
c10::intrusive_ptr<c10::ivalue::Future> toPyFuture(
    const c10::intrusive_ptr<c10::ivalue::Future>& messageFuture);

// For the tests: the request's payload and tensors for `op` on `stack`,
// made by requestMessage() or (`torchs`) by torch's ScriptCall.
std::pair<std::vector<char>, std::vector<at::Tensor>> requestForTest(
    const std::shared_ptr<torch::jit::Operator>& op,
    std::vector<c10::IValue> stack,
    bool torchs);

} // namespace torch_rpc_ext::builtin_call
