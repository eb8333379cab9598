// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// Torch's thread-local state on the agent's own threads: grad and
// inference mode, autocast and other local dispatch keys, a profiler's
// thread-local callbacks, Python modes. User code runs on these threads (a
// served request; a future's callbacks, or a call whose RRef arguments
// waited for their owner, run where the future completes) and can leave
// any of it changed; the next user code there would inherit it. So each
// thread of ours goes back to the state it had the first time it came here
// (a fresh thread's: what TensorPipe's pool threads start from).
//
// Only for threads of ours: never call these where a user's thread may be
// running (a settle inline on the shutdown thread), which would lose its
// state.

namespace torch_rpc_ext::thread_state {

// Back to this thread's first state, whatever it is now (a full set, about
// 320 ns). The first call on a thread (any of these) captures that state:
// make it before any user code ran there.
void reset();

// Back to the first state only if a cheap sign of a change shows: the
// autograd state (grad, inference, forward-grad mode), the local dispatch
// key set (inference mode, autocast, functorch), thread-local record
// function callbacks (a profiler), the Python dispatch and function mode
// stacks. A few nanoseconds when none does; a change in none of them (a
// debug info, saved-tensor hooks alone) is kept.
void resetIfChanged();

// resetIfChanged() when made and when gone: around user code that may run
// on this thread (a future's completion and its callbacks).
struct CheckedScope {
  CheckedScope() {
    resetIfChanged();
  }
  ~CheckedScope() {
    resetIfChanged();
  }
  CheckedScope(const CheckedScope&) = delete;
  CheckedScope& operator=(const CheckedScope&) = delete;
};

} // namespace torch_rpc_ext::thread_state
