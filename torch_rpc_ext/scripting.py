# SPDX-License-Identifier: BSD-3-Clause
"""Remote functions called by name, from eager Python, TorchScript and torch.compile.

On the worker that serves a function (Python or TorchScript)::

    torch_rpc_ext.scripting.register("ps.scale", scale, fake=lambda x, k: torch.empty_like(x))

From any worker of the group (``init_rpc`` on TORCH_RPC_EXT)::

    y = torch_rpc_ext.scripting.rpc_sync("ps", "ps.scale", x, 2.0)  # eager or compiled
    # TorchScript, also in a module saved with torch.jit.save and loaded where
    # only ``import torch_rpc_ext`` is available:
    y = torch.ops.torch_rpc_ext.rpc_sync("ps", "ps.scale", (x, 2.0))

A call is a SCRIPT_CALL of upstream's TorchScript RPC (scripting/ops.cpp), so
timeouts, dist autograd and error responses behave as TorchScript RPC's. A
remote failure reaches the caller as a RuntimeError whose text starts with
the remote exception's type and message ("ValueError: ..."); ``rpc_sync``
here re-raises it as that type when it is a builtin exception.

torch.compile(fullgraph=True): ``rpc_sync`` called from compiled code becomes
one operator, ``torch_rpc_ext::call_tensors``, ordered with the program's
other side effects. Its outputs' shapes come from the ``fake`` the owner gave
at registration, asked once per (worker, name, input shapes, constants) at
compile time and run there on meta tensors, so callers declare nothing.
Compiled calls take tensors (static shapes) and compile-time constants (None,
bool, int, float, str), return tensors, and carry no gradient.
"""

import builtins
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import rpc

from torch_rpc_ext import _C, _torch_private

__all__ = ["register", "unregister", "registered", "rpc_sync", "rpc_async"]

# name -> fake, for the functions this worker registered.
_FAKES: dict[str, Callable[..., Any]] = {}
# On callers: (to, name, input shapes and dtypes, encoded constants) ->
# (returns one tensor, [(shape, dtype)] of the outputs), asked of the owner
# each time such a call is traced, and read by the same trace.
_SPECS: dict[tuple, tuple[bool, list]] = {}
_REMOTE_TYPE = re.compile(r"^(?:Error on Node \d+: )?([A-Za-z_]\w*): ")


def register(name: str, fn: Callable[..., Any], *, fake: Callable[..., Any] | None = None) -> None:
    """Serve ``fn`` (a Python function or a ``torch.jit.script`` function) as ``name``.

    ``fake(*args)``, if given, returns tensors of the shapes and dtypes ``fn``
    would return for ``args`` (it receives meta tensors); callers need it to
    call ``name`` from torch.compile. Registering a name again replaces it.
    """
    _C._scripting.check_name(name)
    if fake is not None and not callable(fake):
        raise TypeError(f"fake for {name!r} must be callable, got {type(fake).__name__}")
    if isinstance(fn, torch.jit.ScriptFunction):
        _C._scripting.register_script(name, fn)
    elif callable(fn):
        _C._scripting.register_python(name, fn)
    else:
        raise TypeError(f"remote function {name!r} must be callable, got {type(fn).__name__}")
    if fake is None:
        _FAKES.pop(name, None)
    else:
        _FAKES[name] = fake


def unregister(name: str) -> bool:
    """Stop serving ``name``; whether it was registered."""
    _FAKES.pop(name, None)
    return _C._scripting.unregister(name)


def registered() -> dict[str, str]:
    """The names this worker serves, with what each is ("python", "torchscript <qualname>")."""
    return dict(_C._scripting.registered())


def rpc_async(to: str | rpc.WorkerInfo, name: str, *args: Any, timeout: float = -1.0) -> Any:
    """Call ``name`` on ``to`` with ``args``; a future (``torch._C.Future``)
    of its value, whose ``wait()`` raises a RuntimeError naming the remote
    exception's type and message on failure.

    ``timeout`` in seconds: -1 is the agent's ``rpc_timeout``, 0 none.
    """
    return torch.ops.torch_rpc_ext.rpc_async(_worker_name(to), name, args, timeout)


def rpc_sync(to: str | rpc.WorkerInfo, name: str, *args: Any, timeout: float = -1.0) -> Any:
    """Call ``name`` on ``to`` with ``args`` and return its value (see ``rpc_async``)."""
    to = _worker_name(to)
    if torch.compiler.is_compiling():
        return _compiled_call(to, name, args, timeout)
    try:
        return torch.ops.torch_rpc_ext.rpc_sync(to, name, args, timeout)
    except RuntimeError as e:
        mapped = _as_remote_type(e)
        if mapped is e:
            raise  # (not `from e`: an error must not be its own cause)
        raise mapped from e


def _worker_name(to: str | rpc.WorkerInfo) -> str:
    return to.name if isinstance(to, rpc.WorkerInfo) else to


def _as_remote_type(error: RuntimeError) -> Exception:
    """The remote exception's builtin type, with the whole text, else ``error``."""
    match = _REMOTE_TYPE.match(str(error))
    kind = getattr(builtins, match.group(1), None) if match else None
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not RuntimeError:
        try:
            return kind(str(error))
        except TypeError:  # a builtin exception with a constructor of its own
            pass
    return error


_CONSTANT_TYPES = (type(None), bool, int, float, str)


def _compiled_call(to: str, name: str, args: tuple, timeout: float) -> Any:
    tensors, constants = [], []
    for i, a in enumerate(args):
        # A scalar torch made dynamic on a second value: the call's
        # constants are fixed at compile time, so it is specialized (a
        # guard: a new value compiles anew), as its shapes are. (Under
        # dynamo, operator.index and __float__ specialize; int() and
        # float() would keep the value symbolic.)
        if isinstance(a, (bool, torch.SymBool)):
            a = bool(a)
        elif isinstance(a, (int, torch.SymInt)):
            a = operator.index(a)
        elif isinstance(a, (float, torch.SymFloat)):
            a = a.__float__()
        if isinstance(a, torch.Tensor):
            tensors.append(a)
        elif isinstance(a, _CONSTANT_TYPES) and _encodable(a):
            constants.append((i, a))
        else:
            raise TypeError(
                f"remote function {name!r} on {to}: a call from torch.compile takes "
                "tensors and constants (None, bool, int, float, str), argument "
                f"{i} is a {type(a).__name__} (call it outside the compiled region)"
            )
    encoded = _encode_constants(tuple(constants))
    # (A size torch made dynamic is specialized here, as in the fake.)
    shapes = tuple((tuple(operator.index(d) for d in t.shape), t.dtype) for t in tensors)
    key = (to, name, shapes, encoded)
    # What the compiled code will read, fixed now: the fake returns it and
    # call_tensors checks the real outputs against it.
    outputs = _compiled_outputs(key)
    outs = torch.ops.torch_rpc_ext.call_tensors(to, name, tensors, encoded, timeout, outputs)
    return outs[0] if _returns_tensor(key) else tuple(outs)


def _encodable(value: Any) -> bool:
    if isinstance(value, str):
        return "\x1f" not in value
    if isinstance(value, int) and not isinstance(value, bool):
        return -(2**63) <= value < 2**63
    return True


@_torch_private.assume_constant_result
def _encode_constants(constants: tuple) -> str:
    """The constants of a compiled call, for call_tensors (scripting/registry.h)."""

    def tagged(v: Any) -> str:
        if v is None:
            return "n"
        if isinstance(v, bool):
            return "b1" if v else "b0"
        if isinstance(v, int):
            return f"i{v}"
        if isinstance(v, float):
            return f"f{v!r}"
        return f"s{v}"

    return "\x1f".join(f"{i}={tagged(v)}" for i, v in constants)


@_torch_private.assume_constant_result
def _compiled_outputs(key: tuple) -> str:
    """The outputs the owner's fake gives the call of ``key``, as
    call_tensors' ``outputs`` text: asked of the owner each time a call is
    traced (a compilation, not a call), since the owner may have replaced
    the function, or a new process taken its rank. (Before session 94 the
    first answer was kept for good, and a replaced function's new outputs
    compiled as its old; before session 98 nothing checked the real outputs
    of a graph compiled before such a change.)"""
    to, name, shapes, constants = key
    with _torch_private.unset_fake_mode():
        _SPECS[key] = rpc.rpc_sync(to, _output_spec, args=(name, list(shapes), constants))
    return _encode_outputs(_SPECS[key][1])


@_torch_private.assume_constant_result
def _returns_tensor(key: tuple) -> bool:
    # The owner's answer, asked by _compiled_outputs when the call above was
    # traced (same key).
    return _SPECS[key][0]


def _encode_outputs(outs: list) -> str:
    """``count|dtype:d0,d1|...`` (dtype as torch names it, without
    ``torch.``): the shapes and dtypes compiled code reads, which
    call_tensors checks the real outputs against (scripting/ops.cpp)."""
    entries = [f"{str(dtype).removeprefix('torch.')}:{','.join(map(str, shape))}" for shape, dtype in outs]
    return "|".join([str(len(outs)), *entries])


def _decode_outputs(text: str) -> list:
    count, *entries = text.split("|")
    if not count.isdigit() or int(count) != len(entries):
        raise ValueError(f"malformed compiled-call outputs {text!r}")
    outs = []
    for entry in entries:
        dtype, _, dims = entry.partition(":")
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"malformed compiled-call outputs {text!r}: no dtype {dtype!r}")
        outs.append((tuple(int(d) for d in dims.split(",")) if dims else (), kind))
    return outs


@torch.library.register_fake("torch_rpc_ext::call_tensors")
def _call_tensors_fake(
    to: str, name: str, args: list, constants: str = "", timeout: float = -1.0, outputs: str = ""
) -> list:
    # Shapes are fixed at compile time: a dynamic size is specialized (a
    # guard: a new shape compiles anew), since the owner's fake runs on
    # meta tensors of static shapes.
    shapes = [(tuple(int(d) for d in a.shape), a.dtype) for a in args]
    device = _call_device(to, name, args)
    if outputs:  # a call from _compiled_call: the owner was asked there
        outs = _decode_outputs(outputs)
    else:  # the operator used directly: ask the owner now
        with _torch_private.unset_fake_mode():
            _, outs = rpc.rpc_sync(to, _output_spec, args=(name, shapes, constants))
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in outs]


def _call_device(to: str, name: str, args: list) -> torch.device:
    """Where a compiled call's outputs are (call_tensors checks the real
    ones against it): the device of its tensors not on the CPU, else the
    CPU."""
    devices = {a.device for a in args if a.device.type != "cpu"}
    if len(devices) > 1:
        raise RuntimeError(
            f"remote function {name!r} on {to}: a call from torch.compile takes "
            f"tensors of one device (and the CPU), got {sorted(map(str, devices))}"
        )
    return devices.pop() if devices else torch.device("cpu")


def _output_spec(name: str, shapes: list, constants: str) -> tuple[bool, list]:
    """On the owner: run ``name``'s fake on meta tensors of ``shapes``, with
    the call's constants at their positions."""
    fake = _FAKES.get(name)
    if fake is None:
        me = rpc.get_worker_info().name
        if name in registered():
            raise LookupError(
                f"remote function {name!r} on {me} has no fake: register it with "
                "fake=... to call it from torch.compile"
            )
        raise LookupError(f"no remote function {name!r} is registered on {me}")
    metas = [torch.empty(s, dtype=d, device="meta") for s, d in shapes]
    out = fake(*_C._scripting.compiled_arguments(metas, constants))
    returns_tensor = isinstance(out, torch.Tensor)
    outs = [out] if returns_tensor else list(out)
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"the fake of {name!r} must return a tensor or a tuple of tensors")
    return returns_tensor, [(tuple(o.shape), o.dtype) for o in outs]


_torch_private.register_ordered_effect("torch_rpc_ext::call_tensors")
