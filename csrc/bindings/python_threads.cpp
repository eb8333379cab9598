// SPDX-License-Identifier: BSD-3-Clause
// One Python thread state per native thread, for the thread's whole life.
//
// torch takes the GIL on our loop threads to run a Python UDF and to
// (un)pickle its arguments and result (pybind11::gil_scoped_acquire). On a
// thread Python has never seen, every such acquisition creates a thread
// state and destroys it again on release: measured at half of a small
// Python UDF round trip (104 -> 50 us). Our threads therefore register one
// state when they start; pybind11 and PyGILState then find and reuse it.
//
// Creating it takes no GIL (PyThreadState_New does not need it), so a loop
// thread promoted while a Python thread holds the GIL starts at once.
// Deleting it needs the GIL; threads run the exit hook before they report
// themselves finished (common/threads.h), and never once the interpreter is
// finalizing: it frees the states that are left.
#include <Python.h>

#include "csrc/bindings/bind.h"
#include "csrc/common/python_state.h"
#include "csrc/common/threads.h"

namespace torch_rpc_ext::bindings {

namespace {

thread_local PyThreadState* tlsState = nullptr;

void onThreadStart() {
  if (!pythonUsable()) {
    return;
  }
  // Also binds it to this thread for PyGILState_GetThisThreadState().
  tlsState = PyThreadState_New(PyInterpreterState_Main());
  // The count of PyGILState/pybind11 holders. Ours is the first: at 0, the
  // first pybind11 scope to release the GIL would delete the state under
  // us. CPython 3.11 sets it to 1 here; keep that true on any version.
  if (tlsState != nullptr && tlsState->gilstate_counter < 1) {
    tlsState->gilstate_counter = 1;
  }
}

void onThreadExit() {
  PyThreadState* state = tlsState;
  tlsState = nullptr;
  if (state == nullptr || !pythonUsable()) {
    return;
  }
  PyEval_RestoreThread(state);
  PyThreadState_Clear(state);
  PyThreadState_DeleteCurrent(); // also releases the GIL
}

} // namespace

void installThreadHooks() {
  setThreadHooks(ThreadHooks{&onThreadStart, &onThreadExit});
}

} // namespace torch_rpc_ext::bindings
