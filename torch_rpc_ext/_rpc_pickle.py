# SPDX-License-Identifier: BSD-3-Clause
"""torch's RPC pickler (``torch.distributed.rpc.internal._internal_rpc_pickler``)
at less cost a call, while one of our agents is current.

A Python UDF's round trip pickles four times (the call and its result, each
way), and torch's ``serialize`` makes a ``BytesIO`` and a ``Pickler`` for
every one, and pickles each tensor's receiver as a bound classmethod (a
``getattr`` of the class by name, pickled and unpickled per message);
``deserialize`` makes an ``Unpickler`` per message. Here the same instance's
``serialize`` and ``deserialize`` are replaced: a pickler per thread, reused
(its memo cleared), the dispatch table torch's own with only the tensor's
and the UDF call's reducers changed, whose receivers are this module's (the
tensors' one object, memoized: written once a message), and
``pickle.loads``. The tensor receiver and the call's constructor are named by
extension codes (``copyreg``, below), which the reader looks up in a dict
where a name costs an import. What is pickled, and how RRefs, ScriptModules and
registered classes reduce, is torch's; torch's unpickler reads the result
where this module can be imported, as on every worker of a group of ours
(protocol version 10, csrc/frame/frame.h, keeps out a build without them). With
another backend's agent current both are torch's as they were.

What ``deserialize`` unpickles is what torch's own would: a Python UDF's
call or result from a peer that passed the group's handshake (a member,
trusted as the RPC model trusts it: docs/security.md). Nothing from the
store or an unauthenticated connection reaches it.
"""

import copyreg
import io
import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.rpc import internal

__all__ = ["install"]

_tables = internal._thread_local_tensor_tables


class _TensorReceiver:
    """A tensor's receiver: ``_RECEIVER(index)`` is the message's tensor
    ``index``. One object, not a function: the pickler memoizes it, so a
    message names it once and each further tensor refers back to it (a
    function named by an extension code is not memoized: pickle's
    ``save_global`` imports its module again for every tensor)."""

    __slots__ = ()

    def __call__(self, index: int) -> torch.Tensor:
        return _tables.recv_tables[index]

    def __reduce__(self) -> str:
        # Pickled or copied outside our pickler: the module's one object.
        return "_RECEIVER"


_RECEIVER = _TensorReceiver()


def _tensor_receiver() -> _TensorReceiver:
    """What a pickle's extension code 0x54525001 constructs: the receiver."""
    return _RECEIVER


def _receiver_reducer(receiver: _TensorReceiver) -> tuple:
    return (_tensor_receiver, ())


def _tensor_reducer(tensor: torch.Tensor) -> tuple:
    sends = _tables.send_tables
    sends.append(tensor)
    return (_RECEIVER, (len(sends) - 1,))


def _udf_from_parts(func: Any, args: Any, kwargs: Any) -> Any:
    """A Python UDF call's constructor (torch's ``PythonUDF``)."""
    return internal.PythonUDF(func, args, kwargs)


def _udf_reducer(udf: Any) -> tuple:
    return (_udf_from_parts, tuple(udf))


# Each global a pickle names is found on reading by an import
# (``find_class``: ``__import__`` of its module, ~0.6-1.4 us here) where an
# extension code is a lookup in ``copyreg``'s cache. Only this module's two
# functions get codes: only our pickles name them, and every reader of one
# has imported this module, so every reader has the codes. (Torch's classes
# keep their names: a process with this module imported may pickle for a
# TensorPipe peer without it.) A code or name taken by another registration
# in this process fails the import, loudly, rather than read as another
# object: _register_extensions.
_EXTENSIONS = (
    ("_tensor_receiver", 0x54525001),
    ("_udf_from_parts", 0x54525002),
)


def _register_extensions() -> None:
    for name, code in _EXTENSIONS:
        try:
            copyreg.add_extension(__name__, name, code)
        except ValueError as e:
            raise RuntimeError(
                f"torch_rpc_ext needs copyreg extension code {code:#x} for "
                f"{__name__}.{name}, and it is taken in this process: {e}"
            ) from None


_register_extensions()


# torch's advice with an AttributeError in unpickling (internal.py), as it
# words it (a line break and its source's indentation included).
_NOT_DEFINED_HERE = (
    "Default RPC pickler does not serialize\n"
    "            function code. Ensure that UDFs are defined on both caller and\n"
    "            callee modules."
)


class _Reused(threading.local):
    def __init__(self) -> None:
        self.file = io.BytesIO()
        self.pickler = internal._pickler(self.file)
        self.busy = False
        # The dispatch table kept, and torch's as it was made from it.
        self.table: dict = {}
        self.source: dict | None = None


def install(active: Callable[[], bool]) -> None:
    """Replace ``serialize`` and ``deserialize`` on torch's RPC pickler
    instance (which ``api``'s default pickler and PythonRpcHandler's
    ``internal.serialize`` / ``deserialize`` both are); ``active()`` says
    whether one of our agents is current. Idempotent."""
    torchs = internal._internal_rpc_pickler
    if getattr(torchs, "_torch_rpc_ext", False):
        return
    cls = type(torchs)
    reused = _Reused()

    def _our_table(obj: Any) -> dict:
        table = torchs._dispatch_table
        table[dist.rpc.PyRRef] = torchs._py_rref_reducer
        table[dist.rpc.RRef] = torchs._rref_reducer
        if isinstance(obj, torch.jit.ScriptModule):
            table[obj.__class__] = torchs._script_module_reducer
        for registered, reducer in torchs._class_reducer_dict.items():
            table[registered] = reducer
        ours = dict(table)
        # (A reducer registered in torch's place stays.)
        if ours.get(torch.Tensor) == torchs._tensor_reducer:
            ours[torch.Tensor] = _tensor_reducer
        if internal.PythonUDF not in ours:
            ours[internal.PythonUDF] = _udf_reducer
        ours[_TensorReceiver] = _receiver_reducer
        return ours

    def serialize(obj: Any) -> tuple:
        if not active() or internal._pickler is not pickle.Pickler:
            return cls.serialize(torchs, obj)
        # The dispatch table: torch's, with the additions torch makes to it
        # on every call (made to it as torch makes them), copied with our
        # reducers in place of torch's (a table is read, never written,
        # while pickling). The copy is kept per thread while torch's table
        # equals what it was made from (torch's additions after the first
        # call set what is already there); a registered class reducer or a
        # ScriptModule makes it anew, as torch's serialize does its own.
        if torchs._class_reducer_dict or isinstance(obj, torch.jit.ScriptModule):
            ours = _our_table(obj)
        elif reused.source == torchs._dispatch_table:
            ours = reused.table
        else:
            ours = _our_table(obj)
            reused.table, reused.source = ours, dict(torchs._dispatch_table)
        # A pickle made while this thread pickles (a reducer's own call)
        # gets a pickler of its own.
        if reused.busy:
            f = io.BytesIO()
            p = internal._pickler(f)
        else:
            f, p = reused.file, reused.pickler
            reused.busy = True
        p.dispatch_table = ours
        # (Looked up in the thread's dict: a getattr that misses raises.)
        outer = _tables.__dict__.get("send_tables")
        _tables.send_tables = tensors = []
        try:
            p.dump(obj)
            return (f.getvalue(), tensors)
        finally:
            if outer is not None:
                _tables.send_tables = outer
            else:
                del _tables.send_tables
            if p is reused.pickler:
                p.clear_memo()
                f.seek(0)
                f.truncate()
                reused.busy = False

    def deserialize(binary_data: Any, tensor_table: Any) -> Any:
        if not active() or internal._unpickler is not pickle.Unpickler:
            return cls.deserialize(torchs, binary_data, tensor_table)
        outer = _tables.__dict__.get("recv_tables")
        _tables.recv_tables = tensor_table
        try:
            return pickle.loads(binary_data)
        except AttributeError as e:
            # A function the reader does not have: returned, not raised, with
            # the advice torch's deserialize gives (not read a second time:
            # receivers read before it, an RRef's fork among them, ran once).
            error = AttributeError(f"{e} {_NOT_DEFINED_HERE}")
            error.__cause__ = e
            return error
        finally:
            if outer is not None:
                _tables.recv_tables = outer
            else:
                del _tables.recv_tables

    torchs.serialize = serialize
    torchs.deserialize = deserialize
    torchs._torch_rpc_ext = True
