// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// A run of completions under one hold of the GIL (Calls::completeHoldingGil)
// runs torch's completion callbacks with the GIL held, which torch never
// does itself. Where such a callback reaches code of torch's that asserts
// the GIL is free, the hold must let it go. The one place known: the agent's
// type resolver, which torch's unpickler calls for a response holding an
// RRef or a TorchScript class, and which starts with
// PythonRpcHandler::getInstance() (asserting !PyGILState_Check()). The
// assertion threw on the completion thread, and the call's Python future
// never completed.

#include <torch/csrc/distributed/rpc/rpc_agent.h>

#include <memory>

namespace torch_rpc_ext::held_gil {

// Marks this thread as inside a hold for its lifetime (made once the GIL is
// taken, gone before it is let go).
class Hold {
 public:
  Hold();
  ~Hold();
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;

 private:
  bool outer_;
};

// `inner` (torch's resolver, set on the agent before start()), wrapped: on a
// thread inside a hold that has the GIL, a resolution lets the GIL go for
// its length. Elsewhere it calls `inner` as it is.
std::shared_ptr<torch::distributed::rpc::TypeResolver> resolverFreeingTheGil(
    std::shared_ptr<torch::distributed::rpc::TypeResolver> inner);

} // namespace torch_rpc_ext::held_gil
