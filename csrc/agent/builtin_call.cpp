// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/builtin_call.h"

#include "csrc/agent/arrival_completion.h"
#include "csrc/agent/small_pickle.h"

#include <ATen/ThreadLocalState.h>
#include <torch/csrc/distributed/autograd/utils.h>
#include <torch/csrc/distributed/rpc/python_resp.h>
#include <torch/csrc/distributed/rpc/python_rpc_handler.h>
#include <torch/csrc/distributed/rpc/script_call.h>
#include <torch/csrc/distributed/rpc/script_resp.h>
#include <torch/csrc/distributed/rpc/utils.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <array>
#include <mutex>
#include <string_view>
#include <unordered_map>

namespace torch_rpc_ext::builtin_call {

namespace {

using JitFuture = c10::ivalue::Future;
using torch::jit::Operator;

// The two texts a builtin call's message names its operator by.
struct OperatorTexts {
  std::shared_ptr<Operator> op; // kept: the key is its address
  c10::IValue schema; // toString(schema), as ScriptCall::toIValues makes it
  c10::IValue name; // aten::add -> torch.ops.aten.add
};

OperatorTexts makeTexts(const std::shared_ptr<Operator>& op) {
  // As ScriptCall::toIValues, its check included.
  constexpr std::string_view kAten = "aten::";
  constexpr std::string_view kBuiltin = "torch.ops.aten.";
  std::string name = op->schema().name();
  TORCH_CHECK(
      name.find("::") == name.rfind("::") && name.rfind(kAten, 0) == 0,
      "Unexpected operator name ",
      name);
  name.replace(0, kAten.size(), kBuiltin);
  return {
      op, c10::IValue(toString(op->schema())), c10::IValue(std::move(name))};
}

// Operators are registered for the process's life and are few (a few
// thousand in all); the table still stops growing at kMaxOperators, past
// which texts are made per call as torch makes them.
class TextTable {
 public:
  static constexpr size_t kMaxOperators = 4096;

  // A copy: two strings' reference counts, not their text.
  std::pair<c10::IValue, c10::IValue> get(const std::shared_ptr<Operator>& op) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = texts_.find(op.get());
      if (it != texts_.end()) {
        return {it->second.schema, it->second.name};
      }
    }
    auto made = makeTexts(op);
    std::pair<c10::IValue, c10::IValue> out{made.schema, made.name};
    std::lock_guard<std::mutex> lock(mutex_);
    if (texts_.size() < kMaxOperators) {
      texts_.emplace(op.get(), std::move(made));
    }
    return out;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const Operator*, OperatorTexts> texts_;
};

TextTable& textTable() {
  // Never destroyed: strings held past libtorch's statics are never freed
  // after them.
  static auto* table = new TextTable();
  return *table;
}

// torch's matchBuiltinOp (python_functions.cpp): operators of the c10
// dispatcher first, then the rest, the first whose schema the arguments
// fit; its error word for word.
std::shared_ptr<Operator> matchOperator(
    const std::string& opName,
    const py::args& args,
    const py::kwargs& kwargs,
    torch::jit::Stack& stack) {
  c10::Symbol symbol = c10::Symbol::fromQualString(opName);
  std::shared_ptr<Operator> matched;
  if (symbol.is_aten()) {
    auto ops = torch::jit::getAllOperatorsFor(symbol);
    std::vector<std::shared_ptr<Operator>> c10Ops;
    for (auto it = ops.begin(); it != ops.end();) {
      if ((*it)->isC10Op()) {
        c10Ops.push_back(std::move(*it));
        it = ops.erase(it);
      } else {
        ++it;
      }
    }
    std::pair<std::shared_ptr<Operator>, torch::jit::Stack> found;
    try {
      found = torch::jit::getOpWithStack(c10Ops, args, kwargs);
    } catch (const std::runtime_error&) {
      found = torch::jit::getOpWithStack(ops, args, kwargs);
    }
    matched = std::move(found.first);
    stack = std::move(found.second);
  }
  TORCH_CHECK(
      matched != nullptr,
      "Failed to match operator name ",
      opName,
      " and arguments "
      "(args: ",
      args,
      ", kwargs: ",
      kwargs,
      ") to a builtin operator");
  return matched;
}

// torch's toPyIValue for the response a builtin call gets (SCRIPT_RET, once
// deserializeResponse has unwrapped distributed autograd's wrapper), or a
// Python UDF's (PYTHON_RET).
c10::IValue toPyIValue(const rpc::Message& message) {
  rpc::MessageType type = message.type();
  auto response = rpc::deserializeResponse(message, type);
  switch (type) {
    case rpc::MessageType::SCRIPT_RET: {
      auto& ret = static_cast<rpc::ScriptResp&>(*response);
      torch::jit::Stack stack;
      stack.push_back(ret.value());
      py::gil_scoped_acquire gil;
      return torch::jit::toIValue(
          torch::jit::createPyObjectForStack(std::move(stack)),
          c10::PyObjectType::get());
    }
    case rpc::MessageType::PYTHON_RET: {
      // (A Python UDF's, through invoke_rpc.h.)
      auto& resp = static_cast<rpc::PythonResp&>(*response);
      auto& handler = rpc::PythonRpcHandler::getInstance();
      py::gil_scoped_acquire gil;
      py::object value = handler.deserialize(resp.serializedPyObj());
      handler.handleException(value);
      return torch::jit::toIValue(value, c10::PyObjectType::get());
    }
    default:
      TORCH_CHECK(false, "Unrecognized response message type ", type);
  }
}

} // namespace

// torch's toPyJitFuture (hasValue): the future the user waits on, completed
// with the Python object, or the error, under the caller's thread-local
// state (grad mode, the profiler's state), as torch's is.
c10::intrusive_ptr<JitFuture> toPyFuture(
    const c10::intrusive_ptr<JitFuture>& messageFuture) {
  auto child = messageFuture->createInstance(c10::PyObjectType::get());
  auto convert = at::wrapPropagateTLSState([child](JitFuture& future) {
    if (future.hasError()) {
      child->setError(future.exception_ptr());
      return;
    }
    const rpc::Message& message = *future.value().toCustomClass<rpc::Message>();
    c10::IValue value;
    try {
      value = toPyIValue(message);
    } catch (py::error_already_set& e) {
      py::gil_scoped_acquire gil;
      // As torch: ValueError and TypeError keep their type.
      if (e.matches(PyExc_ValueError)) {
        child->setErrorIfNeeded(
            std::make_exception_ptr(py::value_error(e.what())));
      } else if (e.matches(PyExc_TypeError)) {
        child->setErrorIfNeeded(
            std::make_exception_ptr(py::type_error(e.what())));
      } else {
        child->setErrorIfNeeded(
            std::make_exception_ptr(std::runtime_error(e.what())));
      }
      e.restore();
      PyErr_Clear();
      return;
    } catch (std::exception&) {
      child->setErrorIfNeeded(std::current_exception());
      return;
    }
    child->markCompleted(value, future.storages());
  });
  if (messageFuture->devices().empty()) {
    messageFuture->addCallback(std::move(convert));
    return child;
  }
  // With devices, torch would run the conversion on a pool stream per
  // device made to wait for the response's events, and record the
  // converted future's there. Where the agent completes the response under
  // the streams its tensors arrived on, which its events were just recorded
  // on, the conversion runs there instead: the converted future's events
  // follow the response's on the same streams. Anywhere else (a response
  // complete before this callback was added runs it here, on the caller's
  // streams), torch's way.
  messageFuture->addCallback(
      [convert = std::move(convert)](JitFuture& future) mutable {
        if (futureCompletingOnArrival() == &future) {
          convert(future);
        } else {
          future.addCallback(std::move(convert));
        }
      },
      /*uses_future=*/false);
  return child;
}

c10::intrusive_ptr<rpc::Message> requestMessage(
    const std::shared_ptr<Operator>& op,
    std::vector<c10::IValue> stack) {
  auto texts = textTable().get(op);
  std::array<c10::IValue, 2> tail{
      std::move(texts.first), std::move(texts.second)};
  std::vector<at::Tensor> tensors;
  auto payload = small_pickle::pickleTuple(stack, tail, tensors);
  if (!payload) {
    // ScriptCall::toMessageImpl: the arguments copied beside the stack it
    // keeps (the pickler memoizes a shared value by pointer, so the copies
    // are part of the bytes), then the schema and the name.
    std::vector<c10::IValue> values;
    values.reserve(stack.size() + 2);
    for (const auto& value : stack) {
      values.push_back(value);
    }
    values.push_back(std::move(tail[0]));
    values.push_back(std::move(tail[1]));
    payload = torch::jit::pickle(
        c10::ivalue::Tuple::create(std::move(values)), &tensors);
  }
  return c10::make_intrusive<rpc::Message>(
      std::move(*payload), std::move(tensors), rpc::MessageType::SCRIPT_CALL);
}

c10::intrusive_ptr<JitFuture> send(
    const rpc::WorkerInfo& dst,
    const std::string& opName,
    const py::args& args,
    const py::kwargs& kwargs,
    float rpcTimeoutSeconds) {
  torch::jit::Stack stack;
  auto op = matchOperator(opName, args, kwargs, stack);
  py::gil_scoped_release release;
  auto message = requestMessage(op, std::move(stack));
  auto agent = rpc::RpcAgent::getCurrentRpcAgent();
  return toPyFuture(
      torch::distributed::autograd::sendMessageWithAutograd(
          *agent, dst, std::move(message), false, rpcTimeoutSeconds));
}

std::pair<std::vector<char>, std::vector<at::Tensor>> requestForTest(
    const std::shared_ptr<Operator>& op,
    std::vector<c10::IValue> stack,
    bool torchs) {
  auto message = torchs ? rpc::ScriptCall(op, std::move(stack)).toMessage()
                        : requestMessage(op, std::move(stack));
  std::vector<at::Tensor> tensors = message->tensors();
  return {std::move(*message).movePayload(), std::move(tensors)};
}

} // namespace torch_rpc_ext::builtin_call
