# SPDX-License-Identifier: BSD-3-Clause
"""torch's RPC pickler, ours while our agent is current (torch_rpc_ext/_rpc_pickle.py):
what it makes reads back as torch's does, either way round, and what it
cannot make fails as torch's does."""

import pickle

import pytest
import torch
from torch.distributed import rpc
from torch.distributed.rpc import internal
from torch.distributed.rpc.internal import PythonUDF

from tests.rpc.world import init, run_world
from torch_rpc_ext import _rpc_pickle, _torch_private

pytestmark = pytest.mark.timeout(180)

_P = internal._internal_rpc_pickler
_TORCHS = type(_P)


def udf(a, b):
    return a + b


@pytest.fixture
def ours(monkeypatch):
    """Our pickling on, as with one of our agents current."""
    _rpc_pickle.install(_torch_private._our_pickling)
    monkeypatch.setattr(_torch_private, "_KEPT_AGENT", [object()])
    monkeypatch.setattr(_torch_private, "_TORCHS_FRONTEND", [False])
    assert _torch_private._our_pickling()


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_round_trips_both_ways(ours):
    t, u = torch.ones(2), torch.arange(3.0)
    call = PythonUDF(udf, (t, [t, u], {"k": (u, 1.5, None, "s")}), {"x": t})
    data, tensors = _P.serialize(call)
    assert b"torch_rpc_ext._rpc_pickle" in data
    # A tensor met twice is one entry (pickle's memo), as torch's.
    assert len(tensors) == 2 and tensors[0] is t and tensors[1] is u
    for reader in (_P.deserialize, lambda d, ts: _TORCHS.deserialize(_P, d, ts)):
        back = reader(data, tensors)
        assert back.func is udf and _same(back.args, call.args) and _same(back.kwargs, call.kwargs)
    # torch's pickle read by ours.
    data, tensors = _TORCHS.serialize(_P, call)
    back = _P.deserialize(data, tensors)
    assert _same(back.args, call.args)
    # No table left behind on this thread.
    assert not hasattr(internal._thread_local_tensor_tables, "send_tables")
    assert not hasattr(internal._thread_local_tensor_tables, "recv_tables")


class _Boxed:
    def __init__(self, value):
        self.value = value


def _boxed_receiver(data, tensors):
    return _Boxed(internal.deserialize(data, tensors))


def _boxed_reducer(boxed):
    # A reducer that pickles on the same thread, as a registered class's
    # may: the inner pickle has a pickler and a tensor table of its own.
    return (_boxed_receiver, internal.serialize(boxed.value))


def test_a_pickle_made_while_pickling(ours, monkeypatch):
    monkeypatch.setitem(_P._class_reducer_dict, _Boxed, _boxed_reducer)
    inner = torch.full((2,), 7.0)
    outer = torch.zeros(1)
    data, tensors = _P.serialize([outer, _Boxed([inner, "x"]), outer])
    # The inner pickle's tensors are in its reduce arguments: the outer
    # table holds them after the outer's own, as with torch's.
    assert len(tensors) == 2 and tensors[0] is outer and tensors[1] is inner
    assert len(_TORCHS.serialize(_P, [outer, _Boxed([inner, "x"]), outer])[1]) == 2
    back = _P.deserialize(data, tensors)
    assert back[0] is outer and back[2] is outer
    assert back[1].value[0] is inner and back[1].value[1] == "x"
    monkeypatch.delitem(_P._class_reducer_dict, _Boxed)
    _P._dispatch_table.pop(_Boxed, None)
    # The reused pickler is free again and clean.
    data, tensors = _P.serialize((inner,))
    assert _P.deserialize(data, tensors)[0] is inner


def test_failures_are_torchs(ours):
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)) as e:
        _P.serialize(PythonUDF(lambda: None, (), {}))
    with pytest.raises(type(e.value)):
        _TORCHS.serialize(_P, PythonUDF(lambda: None, (), {}))
    if hasattr(internal._thread_local_tensor_tables, "send_tables"):
        del internal._thread_local_tensor_tables.send_tables  # torch's leaves it
    # Still usable after a failure.
    t = torch.ones(1)
    assert _P.deserialize(*_P.serialize((t,)))[0] is t
    # A function the reader does not have: torch's error, word for word.
    data = pickle.dumps(PythonUDF(udf, (), {})).replace(b"\x8c\x03udf", b"\x8c\x03fdu")
    ours_err = _P.deserialize(data, [])
    torchs_err = _TORCHS.deserialize(_P, data, [])
    assert isinstance(ours_err, AttributeError) and str(ours_err) == str(torchs_err)


def test_torchs_without_our_agent(monkeypatch):
    _rpc_pickle.install(_torch_private._our_pickling)
    monkeypatch.setattr(_torch_private, "_KEPT_AGENT", [])
    t = torch.ones(2)
    ours_bytes, _ = _P.serialize(PythonUDF(udf, (t,), {}))
    torchs_bytes, _ = _TORCHS.serialize(_P, PythonUDF(udf, (t,), {}))
    assert ours_bytes == torchs_bytes
    monkeypatch.setattr(_torch_private, "_KEPT_AGENT", [object()])
    monkeypatch.setattr(_torch_private, "_TORCHS_FRONTEND", [True])
    ours_bytes, _ = _P.serialize(PythonUDF(udf, (t,), {}))
    assert ours_bytes == torchs_bytes


def udf_calls(rank, world_size):
    init(rank, world_size)
    out = {}
    if rank == 0:
        t = torch.arange(3.0)
        out["ours"] = _torch_private._our_pickling()
        out["sync"] = rpc.rpc_sync("worker1", udf, args=(t, t)).tolist()
        futs = [rpc.rpc_async("worker1", udf, args=(t, float(i))) for i in range(20)]
        out["async"] = [f.wait().tolist()[0] for f in futs]
        rref = rpc.remote("worker1", udf, args=(t, 1.0))
        out["rref"] = rpc.rpc_sync("worker1", udf, args=(rref.to_here(), t)).tolist()
    rpc.shutdown()
    return out


def test_udf_calls_through_the_public_api():
    r = run_world(udf_calls, 2, timeout=90)[0]
    assert r["ours"], r
    assert r["sync"] == [0.0, 2.0, 4.0]
    assert r["async"] == [float(i) for i in range(20)]
    assert r["rref"] == [1.0, 3.0, 5.0]
