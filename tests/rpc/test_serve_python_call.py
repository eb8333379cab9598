# SPDX-License-Identifier: BSD-3-Clause
"""A Python UDF served (csrc/agent/serve_callback.cpp: a synchronous function
run and its result pickled under one hold of the GIL, into one future), and
rpc_sync / rpc_async's steps before a call's frontend (csrc/agent/invoke_rpc.h,
torch's `_invoke_rpc` in C++): what the caller gets, results and errors, is
what it gets from TensorPipe (torch's steps), on each path a call takes
(plain, an RRef argument waited for, wrapped for distributed autograd,
async_execution, TorchScript, the destination by name, rank or WorkerInfo)."""

import threading

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor
from torch.distributed import rpc
from torch.futures import Future

from tests.rpc.world import options, run_world

pytestmark = pytest.mark.timeout(180)


class Stop(BaseException):
    """Escapes torch's _run_function, which turns only Exceptions into a
    RemoteException result."""


def add(a, b):
    return a + b


def returns_lock():
    return threading.Lock()


def raises_base():
    raise Stop("halt")


def raises_value(key):
    raise ValueError(key)


def rref_sum(rref):
    return rref.to_here().sum()


@torch.jit.script
def script_mul(x: Tensor, k: int) -> Tensor:
    return x * k


@rpc.functions.async_execution
@torch.jit.script
def async_script_mul(to: str, x: Tensor, k: int) -> Future[Tensor]:
    return rpc.rpc_async(to, script_mul, (x, k))


@rpc.functions.async_execution
def async_double(x):
    fut = torch.futures.Future()
    fut.set_result(x * 2)
    return fut


def _first_part(text):
    # An error's text up to where C++ names the place that raised it (that
    # place is ours on our agent, upstream's on TensorPipe).
    return text.split("\nException raised from ")[0]


def calls(rank, world_size, backend):
    if backend == "ours":
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=options())
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    out = {}
    if rank == 0:
        x = torch.arange(4.0)
        out["plain"] = rpc.rpc_sync("worker1", add, args=(x, x))
        out["pipelined"] = torch.stack(torch.futures.wait_all(
            [rpc.rpc_async("worker1", add, args=(x, i)) for i in range(50)]))
        # An RRef the caller owns, forked to the callee: the call runs once
        # the owner has confirmed the fork.
        out["rref_arg"] = rpc.rpc_sync("worker1", rref_sum, args=(rpc.RRef(x),))
        out["async"] = rpc.rpc_sync("worker1", async_double, args=(x,))
        with dist_autograd.context() as ctx:
            w = torch.ones(3, requires_grad=True)
            loss = rpc.rpc_sync("worker1", add, args=(w, w)).sum()
            dist_autograd.backward(ctx, [loss])
            out["dist_grad"] = dist_autograd.get_gradients(ctx)[w]
        for key, fn, args in (("unpicklable_result", returns_lock, ()),
                              ("base_exception", raises_base, ()),
                              ("value_error", raises_value, ("k",))):
            try:
                rpc.rpc_sync("worker1", fn, args=args)
                out[key] = "no error"
            except Exception as e:  # noqa: BLE001 (the error itself is the result)
                out[key] = (type(e).__name__, _first_part(str(e)))
        # The destination and arguments in each form rpc_sync takes.
        out["forms"] = [
            rpc.rpc_sync(1, add, args=[x, 1]),
            rpc.rpc_sync(rpc.get_worker_info("worker1"), add, kwargs={"a": x, "b": 2}),
            rpc.rpc_async("worker1", script_mul, args=(x, 3)).wait(),
            rpc.rpc_sync("worker1", script_mul, kwargs={"x": x, "k": 4}),
            rpc.rpc_sync("worker1", async_script_mul, args=("worker0", x, 5)),
            rpc.rpc_sync("worker1", torch.mul, args=[x, 6]),
            rpc.rpc_sync("worker1", add, args=(), kwargs={"a": x, "b": x}),
        ]
        for key, call in (("not_callable", lambda: rpc.rpc_sync("worker1", 5)),
                          ("bad_destination", lambda: rpc.rpc_sync(1.5, add, args=(1, 2))),
                          ("unknown_destination", lambda: rpc.rpc_sync("nobody", add, args=(1, 2))),
                          ("no_operator", lambda: rpc.rpc_sync("worker1", torch.add, args=("a",)))):
            try:
                call()
                out[key] = "no error"
            except Exception as e:  # noqa: BLE001 (the error itself is the result)
                out[key] = (type(e).__name__, _first_part(str(e)))
        out["after"] = rpc.rpc_sync("worker1", add, args=(1, 2))
    rpc.shutdown()
    return out


def test_udf_results_and_errors_are_tensorpipes():
    ours = run_world(calls, backend="ours")[0]
    theirs = run_world(calls, backend="tensorpipe")[0]
    x = torch.arange(4.0)
    assert torch.equal(ours["plain"], x + x)
    assert torch.equal(ours["pipelined"], torch.stack([x + i for i in range(50)]))
    assert ours["rref_arg"] == x.sum()
    assert torch.equal(ours["async"], x * 2)
    assert torch.equal(ours["dist_grad"], torch.full((3,), 2.0))
    assert ours["after"] == 3
    # Errors: the same type and text. A result that cannot be pickled, and
    # an exception that escapes _run_function, as RuntimeErrors with the
    # Python error and its traceback; the traceback's first frame is the
    # pickler's (ours or torch's), so the first line is compared there.
    x1 = x.clone()
    for got, want in zip(ours["forms"], [x1 + 1, x1 + 2, x1 * 3, x1 * 4, x1 * 5, x1 * 6, x1 + x1]):
        assert torch.equal(got, want), ours["forms"]
    # The steps before the frontend, refusing what torch's refuse, alike.
    for key in ("not_callable", "bad_destination", "no_operator"):
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    assert ours["not_callable"] == ("TypeError", "function should be callable.")
    assert ours["bad_destination"][0] == "ValueError"
    # (An unknown name: each agent's own words, naming it.)
    assert ours["unknown_destination"][0] == "RuntimeError" and "nobody" in ours["unknown_destination"][1]
    for key in ("unpicklable_result", "base_exception", "value_error"):
        assert ours[key][0] == theirs[key][0], (key, ours[key], theirs[key])
    assert ours["unpicklable_result"][1].splitlines()[0] == theirs["unpicklable_result"][1].splitlines()[0]
    assert "cannot pickle '_thread.lock' object" in ours["unpicklable_result"][1]
    assert ours["base_exception"][1] == theirs["base_exception"][1]
    assert ours["base_exception"][1].startswith("Stop: halt")
    assert ours["value_error"][0] == "ValueError"
    assert ours["value_error"][1].splitlines()[0] == theirs["value_error"][1].splitlines()[0]
