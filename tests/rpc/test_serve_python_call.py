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
from torch.distributed.rpc import api, internal
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


def no_args():
    return "none"


def _defined_on_caller_only():
    """A function in this module on rank 0 only: the callee cannot find it."""
    def only_on_caller():
        return 1

    only_on_caller.__qualname__ = only_on_caller.__name__
    globals()["only_on_caller"] = only_on_caller
    return only_on_caller


class _Recording(internal._InternalRPCPickler):
    """An RPC pickler of one's own (api._use_rpc_pickler's kind)."""

    def __init__(self):
        super().__init__()
        self.pickled = 0

    def serialize(self, obj):
        self.pickled += 1
        return super().serialize(obj)


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
        out["no_args"] = [rpc.rpc_sync("worker1", no_args), rpc.rpc_sync("worker1", no_args, args=[], kwargs={})]
        # A pickler of one's own for a block: the calls in it use it.
        recording = _Recording()
        with api._use_rpc_pickler(recording):
            inside = rpc.rpc_sync("worker1", add, args=(x, 1))
        rpc.rpc_sync("worker1", add, args=(x, 1))
        out["own_pickler"] = (recording.pickled, torch.equal(inside, x + 1))
        missing = _defined_on_caller_only()
        for key, call in (("not_callable", lambda: rpc.rpc_sync("worker1", 5)),
                          ("missing_on_callee", lambda: rpc.rpc_sync("worker1", missing)),
                          ("tensor_as_args", lambda: rpc.rpc_sync("worker1", add, args=torch.ones(2))),
                          ("pairs_as_kwargs", lambda: rpc.rpc_sync("worker1", torch.add, args=(x,),
                                                                   kwargs=[("other", x)])),
                          ("int_keyword", lambda: rpc.rpc_sync("worker1", torch.add, args=(x, x),
                                                               kwargs={1: 2})),
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
    assert ours["no_args"] == ["none", "none"]
    assert ours["own_pickler"] == (1, True), ours["own_pickler"]
    for key in ("not_callable", "bad_destination", "no_operator", "tensor_as_args",
                "pairs_as_kwargs", "int_keyword"):
        # (Python names the builtin frontend in a `**` refusal: ours or torch's.)
        o, t = ours[key], theirs[key]
        assert (o[0], o[1].split("_invoke_rpc_builtin() ")[-1]) == \
            (t[0], t[1].split("_invoke_rpc_builtin() ")[-1]), (key, o, t)
    assert ours["not_callable"] == ("TypeError", "function should be callable.")
    assert ours["bad_destination"][0] == "ValueError"
    # (An unknown name: each agent's own words, naming it.)
    assert ours["unknown_destination"][0] == "RuntimeError" and "nobody" in ours["unknown_destination"][1]
    # A function the callee does not have: an AttributeError with torch's
    # advice, raised on the caller.
    # (torch's handler re-raises it as a RuntimeError naming AttributeError.)
    o, t = ours["missing_on_callee"], theirs["missing_on_callee"]
    assert o[0] == t[0] and "only_on_caller" in o[1], o
    assert o[1].split("Traceback")[0] == t[1].split("Traceback")[0], (o, t)
    for key in ("unpicklable_result", "base_exception", "value_error"):
        assert ours[key][0] == theirs[key][0], (key, ours[key], theirs[key])
    assert ours["unpicklable_result"][1].splitlines()[0] == theirs["unpicklable_result"][1].splitlines()[0]
    assert "cannot pickle '_thread.lock' object" in ours["unpicklable_result"][1]
    assert ours["base_exception"][1] == theirs["base_exception"][1]
    assert ours["base_exception"][1].startswith("Stop: halt")
    assert ours["value_error"][0] == "ValueError"
    assert ours["value_error"][1].splitlines()[0] == theirs["value_error"][1].splitlines()[0]
