// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/agent/thread_state.h"

#include <optional>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <c10/core/AutogradState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

namespace torch_rpc_ext::thread_state {
namespace {

// What resetIfChanged() compares; cheap to read.
struct Signs {
  bool grad = false;
  bool forwardGrad = false;
  bool inference = false;
  c10::DispatchKeySet included;
  c10::DispatchKeySet excluded;
  bool callbacks = false;
  int64_t dispatchModes = 0;
  int64_t functionModes = 0;

  static Signs now() {
    const auto& autograd = c10::AutogradState::get_tls_state();
    const auto keys = c10::impl::tls_local_dispatch_key_set();
    Signs s;
    s.grad = autograd.get_grad_mode();
    s.forwardGrad = autograd.get_fw_grad_mode();
    s.inference = autograd.get_inference_mode();
    s.included = keys.included_;
    s.excluded = keys.excluded_;
    s.callbacks = at::hasThreadLocalCallbacks();
    s.dispatchModes = c10::impl::TorchDispatchModeTLS::stack_len();
    s.functionModes = at::impl::PythonTorchFunctionTLS::stack_len();
    return s;
  }

  bool operator==(const Signs& o) const {
    return grad == o.grad && forwardGrad == o.forwardGrad &&
        inference == o.inference && included == o.included &&
        excluded == o.excluded && callbacks == o.callbacks &&
        dispatchModes == o.dispatchModes && functionModes == o.functionModes;
  }
};

struct First {
  at::ThreadLocalState state;
  Signs signs = Signs::now();
};

thread_local std::optional<First> first;

} // namespace

void reset() {
  if (!first) {
    first.emplace();
    return;
  }
  at::ThreadLocalState::setThreadLocalState(first->state);
}

void resetIfChanged() {
  if (!first) {
    first.emplace();
    return;
  }
  if (!(Signs::now() == first->signs)) {
    at::ThreadLocalState::setThreadLocalState(first->state);
  }
}

} // namespace torch_rpc_ext::thread_state
