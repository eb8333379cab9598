// SPDX-License-Identifier: BSD-3-Clause
#pragma once

// torch's Python `api._invoke_rpc`, which rpc_sync and rpc_async call (and
// look up in their module on every call), in C++ while an agent of ours is
// current.
//
// torch's is a dozen Python steps before the call's own frontend: find the
// builtin, resolve the destination (two frames and a call into the agent),
// ask twice whether the legacy profiler is on, enter a null context
// manager, check for async_execution, then branch on the kind of function:
// ~3 us of the issuing thread's ~10 us for a builtin call here, and the
// pipelined rate is that thread's. This takes the same steps in the same
// order with the same functions (torch's `_find_builtin`, `_to_worker_info`
// for anything but a name or a WorkerInfo, `_invoke_rpc_torchscript`, the
// RPC pickler and `_invoke_rpc_python_udf`) and the builtin frontend of
// builtin_call.h; with the autograd profiler on, or another backend's agent
// current, it calls the function it replaced, which does the profiling.

#include <torch/csrc/utils/pybind.h>

namespace torch_rpc_ext::invoke_rpc {

namespace py = pybind11;

// The function this one stands in for (torch's `_invoke_rpc`): called for
// another backend's agent and with the profiler on. Set under the GIL.
void setFallback(py::object fn);

// `_invoke_rpc(to, func, rpc_type, args, kwargs, rpc_timeout)`; returns the
// call's future (a torch.futures.Future of the result). Called with the GIL.
py::object invoke(
    const py::object& to,
    const py::object& func,
    const py::object& rpcType,
    py::object args,
    py::object kwargs,
    float rpcTimeoutSeconds);

} // namespace torch_rpc_ext::invoke_rpc
