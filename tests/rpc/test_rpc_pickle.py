# SPDX-License-Identifier: BSD-3-Clause
"""torch's RPC pickler, ours while our agent is current (torch_rpc_ext/_rpc_pickle.py):
what it makes reads back as torch's does, either way round, and what it
cannot make fails as torch's does."""

import copyreg
import importlib
import pickle
import pickletools

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
    # The receiver and the call's constructor by extension code, not by
    # name; the user's function by name.
    codes = {arg for op, arg, _ in pickletools.genops(data) if op.name.startswith("EXT")}
    assert codes == {code for _, code in _rpc_pickle._EXTENSIONS}
    assert b"torch_rpc_ext" not in data and b"PythonUDF" not in data
    assert b"test_rpc_pickle" in data
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


def test_a_message_names_the_tensor_receiver_once(ours):
    # Pickle does not memoize a global written by extension code, so a
    # receiver function met once per tensor was looked up (its module
    # imported) once per tensor; the receiver object is memoized: one
    # extension code a message, then references back to it.
    xs = [torch.full((2,), float(i)) for i in range(50)]
    data, tensors = _P.serialize(PythonUDF(udf, (xs,), {}))
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(data)]
    receiver_code = dict(_rpc_pickle._EXTENSIONS)["_tensor_receiver"]
    assert sum(1 for name, arg in ops if name.startswith("EXT") and arg == receiver_code) == 1
    assert len(tensors) == 50
    back = _P.deserialize(data, tensors)
    assert all(a is b for a, b in zip(back.args[0], xs))
    assert _TORCHS.deserialize(_P, data, tensors).args[0][49] is xs[49]


def test_an_extension_code_taken_is_a_clear_error():
    code = _rpc_pickle._EXTENSIONS[0][1]
    copyreg.remove_extension(_rpc_pickle.__name__, "_tensor_receiver", code)
    copyreg.add_extension("somebody.else", "thing", code)
    try:
        with pytest.raises(RuntimeError, match=f"extension code {code:#x} .* taken"):
            importlib.reload(_rpc_pickle)
    finally:
        copyreg.remove_extension("somebody.else", "thing", code)
        importlib.reload(_rpc_pickle)
    assert copyreg._extension_registry[(_rpc_pickle.__name__, "_tensor_receiver")] == code


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
    # A function the reader does not have: torch's error, returned.
    data = pickle.dumps(PythonUDF(udf, (), {})).replace(b"\x8c\x03udf", b"\x8c\x03fdu")
    ours_err = _P.deserialize(data, [])
    torchs_err = _TORCHS.deserialize(_P, data, [])
    assert isinstance(ours_err, AttributeError) and isinstance(torchs_err, AttributeError)
    assert str(ours_err).split() == str(torchs_err).split()


_RECEIVED = []


def _count_received(value):
    _RECEIVED.append(value)
    return value


class _Counted:
    def __reduce__(self):
        return (_count_received, ("once",))


def test_a_missing_function_reads_the_message_once(ours):
    # Receivers before the missing name (an RRef's fork is one) run once,
    # as with torch's.
    data = pickle.dumps([_Counted(), udf]).replace(b"\x8c\x03udf", b"\x8c\x03fdu")
    _RECEIVED.clear()
    assert isinstance(_P.deserialize(data, []), AttributeError)
    assert _RECEIVED == ["once"]
    assert not hasattr(internal._thread_local_tensor_tables, "recv_tables")


def test_a_failure_in_a_large_pickle_leaves_the_pickler_clean(ours):
    # Over 64 KiB the pickler writes frames to its file as it goes.
    big = PythonUDF(udf, (b"x" * 200_000, torch.ones(2), lambda: None), {})
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        _P.serialize(big)
    t = torch.ones(3)
    data, tensors = _P.serialize((t, "after"))
    assert len(data) < 1000 and _P.deserialize(data, tensors) == (t, "after")


def test_a_tensor_reducer_registered_in_torchs_place_stays(ours, monkeypatch):
    def reducer(tensor):
        return (torch.zeros, (5,))

    monkeypatch.setitem(_P._dispatch_table, torch.Tensor, reducer)
    data, tensors = _P.serialize((torch.ones(1),))
    assert tensors == [] and _P.deserialize(data, tensors)[0].shape == (5,)


def test_threads_pickle_apart(ours):
    import threading

    errors = []

    def work(i):
        try:
            mine = torch.full((2,), float(i))
            for _ in range(300):
                data, tensors = _P.serialize(PythonUDF(udf, (mine, i), {}))
                back = _P.deserialize(data, tensors)
                assert back.args[0] is mine and back.args[1] == i and tensors == [mine]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


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


def rref_sum(a, b):
    return a.to_here() + b.to_here().sum()


def make_rref(t):
    return rpc.RRef(t * 2)


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
        # RRefs pickled as arguments and results (their forks are made and
        # confirmed as they are pickled and read).
        mine = rpc.RRef(torch.ones(2))
        out["rref_args"] = rpc.rpc_sync("worker1", rref_sum, args=(rref, mine)).tolist()
        back = rpc.rpc_sync("worker1", make_rref, args=(t,))
        out["rref_result"] = back.to_here().tolist()
    rpc.shutdown()
    return out


def test_udf_calls_through_the_public_api():
    r = run_world(udf_calls, 2, timeout=90)[0]
    assert r["ours"], r
    assert r["sync"] == [0.0, 2.0, 4.0]
    assert r["async"] == [float(i) for i in range(20)]
    assert r["rref"] == [1.0, 3.0, 5.0]
    assert r["rref_args"] == [3.0, 4.0, 5.0]
    assert r["rref_result"] == [0.0, 2.0, 4.0]
