// SPDX-License-Identifier: BSD-3-Clause
// Which call future this thread is completing under the streams its
// response's tensors arrived on (Calls::complete), so that a callback of
// that future may take those streams as current instead of a pool stream
// per device made to wait for the future's events (torch's invokeCallback):
// builtin_call::toPyFuture converts a response into its Python value there,
// one future with devices a call fewer (an event, a stream wait and the
// pool streams' exchange).
#pragma once

#include <ATen/core/ivalue.h>

namespace torch_rpc_ext {

// The future being completed on this thread on its arrival streams, or
// nullptr. Only that future's own callbacks may rely on it: a callback of
// another future run meanwhile (a user's then() of the converted one, say)
// sees another future, and so does the callback of a future completed
// before it was added, which runs on the adding thread.
const c10::ivalue::Future* futureCompletingOnArrival();

class CompletingOnArrival {
 public:
  explicit CompletingOnArrival(const c10::ivalue::Future* future);
  ~CompletingOnArrival();
  CompletingOnArrival(const CompletingOnArrival&) = delete;
  CompletingOnArrival& operator=(const CompletingOnArrival&) = delete;

 private:
  const c10::ivalue::Future* outer_;
};

} // namespace torch_rpc_ext
