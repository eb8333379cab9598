# SPDX-License-Identifier: BSD-3-Clause
"""A builtin call's frontend (csrc/agent/builtin_call.h): torch's
``_invoke_rpc_builtin`` with the operator's texts kept and a pickler for
the common arguments (small_pickle.h). Its request is torch's, byte for
byte; through the public API it answers, fails, records gradients and
profiles as torch's frontend does."""

import math

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch.distributed import rpc
from torch.distributed.rpc import api

from tests.rpc.world import free_port, init, run_world
from torch_rpc_ext import _C, _testing, _torch_private

pytestmark = pytest.mark.timeout(180)

_T = torch.ones(2)
_U = torch.arange(3.0, requires_grad=True)

# (operator, args, kwargs): every kind the small pickler writes (tensors,
# one twice, ints of each width, floats, bools, None, strings) and kinds it
# leaves to torch's (int lists, tensor lists, dtypes as ints are its own).
REQUESTS = [
    ("aten::add", (_T, _T), {}),
    ("aten::add", (_T, _U), {"alpha": 2.5}),
    ("aten::add", (_T, 1), {}),
    ("aten::add", (_T, 300), {}),
    ("aten::add", (_T, 70000), {}),
    ("aten::add", (_T, -3), {}),
    ("aten::add", (_T, 2**40), {}),
    ("aten::add", (_T, -(2**40)), {}),
    ("aten::add", (_T, True), {}),
    *[("aten::add", (_T, n), {}) for n in
      (255, 256, 65535, 65536, -1, -(2**31), 2**31 - 1, 2**31, -(2**31) - 1)],
    # Two equal strings: the second a memo reference (aten::add.str).
    ("aten::add", ("ab", "ab"), {}),
    ("aten::mul", (_T, float("nan")), {}),
    ("aten::mul", (_T, -0.0), {}),
    ("aten::neg", (_T,), {}),
    ("aten::div", (_T, _U), {"rounding_mode": "floor"}),
    ("aten::div", (_T, _U), {"rounding_mode": None}),
    ("aten::clamp", (_T,), {"min": None, "max": 1.0}),
    ("aten::where", (_T > 0, _T, _U), {}),
    ("aten::to", (_T, torch.float64), {}),
    ("aten::zeros_like", (torch.empty(0),), {}),
    ("aten::sum", (_T,), {"dim": [0]}),
    ("aten::cat", ([_T, _T],), {}),
    ("aten::ones", ((2, 3),), {}),
]


@pytest.mark.parametrize("op,args,kwargs", REQUESTS, ids=lambda v: str(v)[:24])
def test_request_bytes_are_torchs(op, args, kwargs):
    ours, our_tensors = _testing.builtin_request(op, False, *args, **kwargs)
    torchs, their_tensors = _testing.builtin_request(op, True, *args, **kwargs)
    assert ours == torchs
    assert len(our_tensors) == len(their_tensors)
    for a, b in zip(our_tensors, their_tensors):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape


def test_torchs_frontend_kept_on_request(monkeypatch):
    replaced, ours, fallbacks = object(), object(), []
    our_invoke, invoke_fallbacks = object(), []

    def replaced_invoke():  # torch's, as far as the install can tell
        pass

    replaced_invoke.__module__, replaced_invoke.__qualname__ = api.__name__, "_invoke_rpc"
    monkeypatch.setattr(api, "_invoke_rpc_builtin", replaced)
    monkeypatch.setattr(api, "_invoke_rpc", replaced_invoke)
    monkeypatch.setattr(_torch_private, "_REPLACED_FRONTEND", {})
    monkeypatch.setattr(_torch_private, "_TORCHS_FRONTEND", [False])

    def install():
        _torch_private.install_builtin_frontend(
            ours, fallbacks.append, our_invoke, invoke_fallbacks.append)

    monkeypatch.setenv("TORCH_RPC_EXT_TORCH_FRONTEND", "1")
    install()
    assert api._invoke_rpc_builtin is replaced and fallbacks == []
    assert api._invoke_rpc is replaced_invoke and invoke_fallbacks == []
    monkeypatch.delenv("TORCH_RPC_EXT_TORCH_FRONTEND")
    install()
    assert api._invoke_rpc_builtin is ours and fallbacks == [replaced]
    assert api._invoke_rpc is our_invoke and invoke_fallbacks == [replaced_invoke]
    # A second init keeps them, and what they call for another agent.
    install()
    assert api._invoke_rpc_builtin is ours and fallbacks == [replaced]
    assert api._invoke_rpc is our_invoke and invoke_fallbacks == [replaced_invoke]
    # Asked for torch's at a later init: what they replaced is back.
    monkeypatch.setenv("TORCH_RPC_EXT_TORCH_FRONTEND", "1")
    install()
    assert api._invoke_rpc_builtin is replaced and api._invoke_rpc is replaced_invoke
    # Under our tracing's wrapper, ours goes beneath it (the span around it).
    monkeypatch.delenv("TORCH_RPC_EXT_TORCH_FRONTEND")

    def traced():
        pass

    traced._torch_rpc_ext_inner = inner = [replaced_invoke]
    monkeypatch.setattr(api, "_invoke_rpc", traced)
    install()
    assert api._invoke_rpc is traced and inner == [our_invoke]
    # Another library's patch of it stays (and calls what it wrapped).

    def patched():
        pass

    monkeypatch.setattr(api, "_invoke_rpc", patched)
    install()
    assert api._invoke_rpc is patched


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - its text is compared
        return type(e), str(e)
    return None


def builtin_calls(rank, world_size):
    init(rank, world_size)
    out = {}
    if rank == 0:
        out["ours"] = (api._invoke_rpc_builtin is _C._invoke_rpc_builtin
                       and api._invoke_rpc is _C._invoke_rpc)
        t = torch.arange(4.0)
        out["values"] = [
            rpc.rpc_sync("worker1", torch.add, args=(t, t)).tolist(),
            rpc.rpc_sync("worker1", torch.add, args=(t, 2), kwargs={"alpha": 3}).tolist(),
            rpc.rpc_async("worker1", torch.div, args=(t, 3),
                          kwargs={"rounding_mode": "floor"}).wait().tolist(),
            rpc.rpc_sync("worker1", torch.sum, args=(t,), kwargs={"dim": [0]}).item(),
            rpc.rpc_sync("worker1", torch.cat, args=([t, t],)).tolist(),
            # A result that is not a tensor.
            rpc.rpc_sync("worker1", torch.numel, args=(t,)),
            [f.wait().item() for f in
             [rpc.rpc_async("worker1", torch.mul, args=(t[i], 2.5)) for i in range(4)]],
        ]
        # Errors as torch's frontend raises them, on the same agent: no
        # operator fits, and the operator's own error on the callee.
        wi = api._to_worker_info("worker1")
        torchs = torch._C._distributed_rpc._invoke_rpc_builtin
        out["no_fit"] = (
            _error(lambda: rpc.rpc_sync("worker1", torch.add, args=(t, "b"))),
            _error(lambda: torchs(wi, "aten::add", 10.0, t, "b").wait()),
        )
        out["callee_error"] = (
            _error(lambda: rpc.rpc_sync("worker1", torch.add,
                                        args=(torch.ones(2), torch.ones(3)))),
            _error(lambda: torchs(wi, "aten::add", 10.0,
                                  torch.ones(2), torch.ones(3)).wait()),
        )
        # Distributed autograd: the call records its send and receive.
        with dist_autograd.context() as ctx:
            x = torch.ones(3, requires_grad=True)
            y = rpc.rpc_sync("worker1", torch.mul, args=(x, 4))
            dist_autograd.backward(ctx, [y.sum()])
            out["grad"] = dist_autograd.get_gradients(ctx)[x].tolist()
        # rpc_sync's steps are ours (torch's _invoke_rpc only with the
        # profiler on): what it falls back to, recorded.
        fallback = _torch_private._REPLACED_FRONTEND["_invoke_rpc"]
        taken = []

        def recorded(*args, **kwargs):
            taken.append(args[1])
            return fallback(*args, **kwargs)

        _C._set_invoke_rpc_fallback(recorded)
        try:
            rpc.rpc_sync("worker1", torch.add, args=(t, 1))
            rpc.rpc_async("worker1", torch.add, args=(t, 1)).wait()
            plain = len(taken)
            with torch.autograd.profiler_legacy.profile():
                rpc.rpc_sync("worker1", torch.add, args=(t, 1))
            out["fallback_taken"] = (plain, len(taken))
        finally:
            _C._set_invoke_rpc_fallback(fallback)
        # torch's legacy profiler: the callee's operator in the caller's trace.
        with torch.autograd.profiler_legacy.profile() as prof:
            rpc.rpc_sync("worker1", torch.add, args=(t, 1))
        out["profiled"] = [e.name for e in prof.function_events]
    rpc.shutdown()
    return out


def test_builtin_calls_through_the_public_api():
    r = run_world(builtin_calls, 2, timeout=90)[0]
    assert r["ours"], r
    v = r["values"]
    assert v[0] == [0.0, 2.0, 4.0, 6.0]
    assert v[1] == [6.0, 7.0, 8.0, 9.0]
    assert v[2] == [0.0, 0.0, 0.0, 1.0]
    assert math.isclose(v[3], 6.0)
    assert v[4] == [0.0, 1.0, 2.0, 3.0] * 2
    assert v[5] == 4
    assert v[6] == [0.0, 2.5, 5.0, 7.5]
    ours, torchs = r["no_fit"]
    assert ours is not None and ours == torchs, r["no_fit"]
    ours, torchs = r["callee_error"]
    assert ours is not None and ours == torchs, r["callee_error"]
    assert r["fallback_taken"] == (0, 1), r["fallback_taken"]
    assert r["grad"] == [4.0, 4.0, 4.0]
    assert any("rpc_sync#aten::add" in name and "worker1" in name
               for name in r["profiled"]), r["profiled"]
    assert "rpc_sync#aten::add(worker0 -> worker1)#remote_op: aten::add" in r["profiled"], \
        r["profiled"]


def ours_then_tensorpipe(rank, world_size, tp_port):
    init(rank, world_size)
    out = {}
    if rank == 0:
        out["ours"] = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist()
    rpc.shutdown()
    # The same processes on TensorPipe: ours stays installed and hands the
    # call to torch's frontend.
    rpc.init_rpc(
        f"tp{rank}", rank=rank, world_size=world_size,
        backend=rpc.BackendType.TENSORPIPE,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{tp_port}", rpc_timeout=30,
            _transports=["uv"]),
    )
    if rank == 0:
        out["installed"] = (api._invoke_rpc_builtin is _C._invoke_rpc_builtin
                            and api._invoke_rpc is _C._invoke_rpc)
        out["tensorpipe"] = rpc.rpc_sync("tp1", torch.add, args=(torch.ones(2), 2)).tolist()
    rpc.shutdown()
    return out


def test_another_agent_gets_torchs_frontend():
    r = run_world(ours_then_tensorpipe, 2, timeout=120, tp_port=free_port())[0]
    assert r["ours"] == [2.0, 2.0] and r["tensorpipe"] == [3.0, 3.0], r
    assert r["installed"], r
