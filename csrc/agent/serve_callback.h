// SPDX-License-Identifier: BSD-3-Clause
// The request callback the agent serves with: upstream's RequestCallbackImpl,
// with SCRIPT_CALL requests (builtin operators and TorchScript functions)
// decoded without re-parsing the operator's schema on every call, and
// PYTHON_CALL and SCRIPT_CALL requests served with fewer futures and
// hand-offs of the GIL.
#pragma once

#include <torch/csrc/distributed/rpc/request_callback_impl.h>
#include <torch/csrc/distributed/rpc/script_call.h>
#include <torch/csrc/jit/runtime/operator.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "csrc/agent/remote_creations.h"

namespace torch_rpc_ext {

// A builtin call names its operator by the full schema text
// ("aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor").
// Upstream resolves that text on every request: it parses the schema, then
// prints every overload of the operator until one prints the same (~4 us to
// parse plus ~1.4 us per overload printed: more than half of a small call's
// server time). We resolve each text once, the same way (through upstream's
// own ScriptCall::fromMessage), and remember the operator it named.
//
// A SCRIPT_CALL naming kNamedFunctionPrefix + name is served by the
// scripting layer's table (named_functions.h), on every path that reaches
// processScriptCall (plain, wrapped for dist autograd, or profiled).
//
// A user's deletion of a remote() call's fork that arrives while the call
// is still being served is applied as it ends (remote_creations.h).
//
// Everything else about serving is upstream's: pending RRefs in arguments,
// the server-side process-global profiler, errors, and the autograd and
// profiling wrappers (processMessage runs upstream's sequence for them, so
// that a remote() they wrap counts as being created from its decoding).
class ServeCallback final
    : public torch::distributed::rpc::RequestCallbackImpl {
 public:
  // Distinct schema texts remembered at most; past it, lookups still work
  // and take upstream's slow path. Only texts that named a registered
  // operator are ever stored, so peers cannot grow the table with junk.
  static constexpr size_t kMaxCachedOperators = 4096;

  c10::intrusive_ptr<torch::distributed::rpc::JitFuture> processMessage(
      torch::distributed::rpc::Message& request,
      std::vector<c10::Stream> streams) const override;

  c10::intrusive_ptr<torch::distributed::rpc::JitFuture> processScriptCall(
      torch::distributed::rpc::RpcCommandBase& rpc,
      const std::vector<c10::Stream>& streams) const override;

  // A synchronous Python UDF: run and its result pickled under one hold of
  // the GIL, into one future (upstream: two of each).
  // An @async_execution one's answer is serialized, as upstream's, once its
  // future completes, but with the handler taken now: the future may be
  // completed by a thread holding the GIL (Calls::completeHoldingGil, a
  // call a user's thread made), where upstream's PythonRpcHandler::
  // getInstance() asserts the GIL is free.
  c10::intrusive_ptr<torch::distributed::rpc::JitFuture> processPythonCall(
      torch::distributed::rpc::RpcCommandBase& rpc,
      const std::vector<c10::Stream>& streams) const override;

  // to_here() of a Python RRef: upstream's, the handler taken now (the
  // owner's value may be set by such a completion, too).
  c10::intrusive_ptr<torch::distributed::rpc::JitFuture>
  processPythonRRefFetchCall(
      torch::distributed::rpc::RpcCommandBase& rpc) const override;

  // remote() calls, Python or TorchScript, on every path (plain, wrapped
  // for dist autograd, profiled): upstream's, with the fork they create
  // marked as being created meanwhile.
  c10::intrusive_ptr<torch::distributed::rpc::JitFuture> processPythonRemoteCall(
      torch::distributed::rpc::RpcCommandBase& rpc,
      const std::vector<c10::Stream>& streams) const override;
  c10::intrusive_ptr<torch::distributed::rpc::JitFuture> processScriptRemoteCall(
      torch::distributed::rpc::RpcCommandBase& rpc,
      const std::vector<c10::Stream>& streams) const override;

  // Schema texts resolved so far (for tests).
  size_t cachedOperators() const;
  // User deletions that arrived while the remote() call creating their
  // fork was being served (applied as it ended).
  int64_t deletionsBeforeCreation() const {
    return creations_.deferred();
  }

 private:
  using Fork = std::
      pair<torch::distributed::rpc::RRefId, torch::distributed::rpc::ForkId>;
  // The fork a remote() call creates, wrapped or not (none for another
  // request, or a remote() to ourselves, whose OwnerRRef the caller made).
  static std::optional<Fork> createdFork(
      torch::distributed::rpc::RpcCommandBase& call,
      torch::distributed::rpc::MessageType type);
  // `serve()`, then one begin() of `fork`'s creation ends (if any; also if
  // it throws).
  c10::intrusive_ptr<torch::distributed::rpc::JitFuture> whileCreating(
      const std::optional<Fork>& fork,
      const std::function<
          c10::intrusive_ptr<torch::distributed::rpc::JitFuture>()>& serve)
      const;
  // One begin() of `fork`'s creation ended: a deletion that arrived
  // meanwhile is applied, as torch applies one (never throws).
  void creationEnded(const Fork& fork) const;
  // A RREF_USER_DELETE of a fork whose creation is being served: answered
  // now and kept. Null otherwise (served as usual).
  c10::intrusive_ptr<torch::distributed::rpc::JitFuture> deletionBeforeCreation(
      const torch::distributed::rpc::Message& request) const;
  c10::intrusive_ptr<torch::distributed::rpc::JitFuture> processRemoteCall(
      torch::distributed::rpc::RpcCommandBase& rpc,
      const std::vector<c10::Stream>& streams,
      torch::distributed::rpc::MessageType type) const;

  // Decodes a SCRIPT_CALL once, and names a traced serve's span by it
  // (tracing::ScriptNaming).
  std::unique_ptr<torch::distributed::rpc::ScriptCall> decodeScriptCall(
      const torch::distributed::rpc::Message& request) const;
  std::unique_ptr<torch::distributed::rpc::ScriptCall> decodeScriptCallUnnamed(
      const torch::distributed::rpc::Message& request) const;
  static bool isNamedFunction(const torch::distributed::rpc::ScriptCall& call);
  // Whether processRpcWithErrors serves `call` into one future completed
  // on the request's streams (a synchronous Python UDF, a builtin
  // operator, a function served by name), which processMessage then
  // returns as it is rather than mirrored by thenAsync.
  static bool servedInOneFuture(
      const torch::distributed::rpc::RpcCommandBase& call,
      torch::distributed::rpc::MessageType type);

  mutable RemoteCreations creations_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<std::string, std::shared_ptr<torch::jit::Operator>>
      operators_;
};

} // namespace torch_rpc_ext
