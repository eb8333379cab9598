# SPDX-License-Identifier: BSD-3-Clause
"""Every private torch.distributed.rpc touchpoint, and every difference
between the torch releases we run on (the tested range: _torch_range), so a
torch upgrade edits one file; the one other is _rpc_pickle.py (torch's RPC
pickler's internals: its instance, dispatch table and tensor tables). The
C++ side's are csrc/agent/torch_version.h, csrc/agent/builtin_call.cpp
for torch's builtin-call frontend, csrc/agent/invoke_rpc.cpp for the steps
of torch's `api._invoke_rpc` (and the Python objects of torch's it looks
up), and csrc/agent/serve_callback.cpp for upstream's request callback."""

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import api, backend_registry

from torch_rpc_ext._torch_range import minor

# (major, minor) of the running torch.
TORCH_MINOR = minor(torch.__version__)
# torch 2.14 checks device maps against the current accelerator's device type
# (backend_registry._tensorpipe_validate_devices); 2.13 against "cuda".
VALIDATES_DEVICES_BY_ACCELERATOR = TORCH_MINOR >= (2, 14)

__all__ = [
    "TORCH_MINOR",
    "VALIDATES_DEVICES_BY_ACCELERATOR",
    "register_backend",
    "init_rpc_states",
    "release_agent",
    "validate_device_maps",
    "register_ordered_effect",
    "assume_constant_result",
    "unset_fake_mode",
    "current_agent",
    "update_worker_names",
    "install_shutdown",
    "watched_wait_all_workers",
    "install_builtin_frontend",
]


def register_backend(
    name: str, construct_options: Callable[..., Any], init_backend: Callable[..., Any]
) -> Any:
    """Register ``name`` once and return its ``BackendType`` member.

    ``register_backend`` replaces ``backend_registry.BackendType`` with a new
    enum, while ``torch.distributed.rpc.BackendType`` still points at the old
    one, which breaks ``init_rpc`` for every backend (TensorPipe included).
    Re-pointing the public name repairs default init, explicit
    ``BackendType.TENSORPIPE`` and inference from options.
    """
    if not backend_registry.backend_registered(name):
        backend_registry.register_backend(name, construct_options, init_backend)
    rpc.BackendType = backend_registry.BackendType
    return backend_registry.BackendType[name]


def install_builtin_frontend(ours: Callable[..., Any],
                             set_fallback: Callable[[Any], None],
                             invoke: Callable[..., Any] | None = None,
                             set_invoke_fallback: Callable[[Any], None] | None = None) -> None:
    """Send builtin calls through ``ours`` (``_C._invoke_rpc_builtin``:
    csrc/agent/builtin_call.h), which is torch's ``_invoke_rpc_builtin``
    without printing the operator's schema on every call, and ``rpc_sync`` /
    ``rpc_async``'s steps before it through ``invoke`` (``_C._invoke_rpc``:
    csrc/agent/invoke_rpc.h, torch's ``_invoke_rpc`` in C++); each calls the
    function it replaces (``set_fallback``, ``set_invoke_fallback``) while
    another backend's agent is current. ``api`` looks both names up in its
    module on every call. Kept after shutdown; ``TORCH_RPC_EXT_TORCH_FRONTEND=1``
    at an init puts the replaced functions back. Python UDFs' pickling too
    (_rpc_pickle), while our agent is current and that is not set."""
    import os

    from torch_rpc_ext import _rpc_pickle

    torchs = os.environ.get("TORCH_RPC_EXT_TORCH_FRONTEND") == "1"
    _TORCHS_FRONTEND[0] = torchs
    replacing = [("_invoke_rpc_builtin", ours, set_fallback)]
    if invoke is not None and set_invoke_fallback is not None:
        replacing.append(("_invoke_rpc", invoke, set_invoke_fallback))
    for name, mine, set_replaced in replacing:
        get, put = _frontend_slot(name)
        current = get()
        if torchs:
            if current is mine:
                put(_REPLACED_FRONTEND[name])
            continue
        if current is mine:
            continue
        if name == "_invoke_rpc" and not _is_torchs_invoke_rpc(current):
            # Another library's patch of it stays, and calls what it wrapped
            # (torch's, which reaches our builtin frontend through the
            # module's global).
            continue
        _REPLACED_FRONTEND[name] = current
        set_replaced(current)
        put(mine)
    if not torchs:
        _rpc_pickle.install(_our_pickling)


def _frontend_slot(name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Where ``api.<name>``'s function is: the module's global, or, under our
    tracing's wrapper of it (torch_rpc_ext/tracing.py), what that wraps."""
    inner = getattr(getattr(api, name), "_torch_rpc_ext_inner", None)
    if inner is not None:
        return (lambda: inner[0]), (lambda fn: inner.__setitem__(0, fn))
    return (lambda: getattr(api, name)), (lambda fn: setattr(api, name, fn))


def _is_torchs_invoke_rpc(fn: Any) -> bool:
    return (getattr(fn, "__module__", None) == api.__name__
            and getattr(fn, "__qualname__", None) == "_invoke_rpc")


# What install_builtin_frontend replaced (torch's, or another's patch), by
# name in torch.distributed.rpc.api.
_REPLACED_FRONTEND: dict[str, Any] = {}
# TORCH_RPC_EXT_TORCH_FRONTEND=1 at the last init.
_TORCHS_FRONTEND = [False]


def _our_pickling() -> bool:
    """torch's RPC pickler is ours (_rpc_pickle): one of our agents is
    current, and torch's frontend was not asked for."""
    return bool(_KEPT_AGENT) and not _TORCHS_FRONTEND[0]


def init_rpc_states(agent: Any) -> None:
    """Publish the agent's worker names and make it the current, started
    agent, whose Python object is then kept until ``rpc.shutdown`` (below)."""
    _install_agent_release()
    api._init_rpc_states(agent)
    _KEPT_AGENT[:] = [agent]


# The current agent's Python object, while it is current. torch's frontend
# fetches the current agent on every rpc_sync / rpc_async / remote
# (``_to_worker_info``); with no Python reference alive, each fetch made a
# new wrapper (pybind11 registers and unregisters it) and dropped it, and
# dropping our agent's wrapper releases the GIL (its destructor may join
# threads that take it): a GIL hand-off to the completion thread on every
# call of the issuing thread. Kept, each fetch finds the same object.
_KEPT_AGENT: list[Any] = []


def release_agent() -> None:
    """Drop the kept agent object (shutdown; an init that failed after
    ``init_rpc_states``)."""
    _KEPT_AGENT.clear()


def _install_agent_release() -> None:
    """``rpc.shutdown`` (graceful or not) ends in ``api._finalize_shutdown``,
    looked up as a module global: the kept object is dropped after it, when
    torch no longer names the agent current. Idempotent."""
    if getattr(api._finalize_shutdown, "_torch_rpc_ext_release", False):
        return
    finalize = api._finalize_shutdown

    def _finalize_shutdown(*args: Any, **kwargs: Any) -> Any:
        try:
            return finalize(*args, **kwargs)
        finally:
            release_agent()

    _finalize_shutdown._torch_rpc_ext_release = True  # type: ignore[attr-defined]
    api._finalize_shutdown = _finalize_shutdown


def validate_device_maps(
    names: list[str],
    counts: dict[str, int],
    device_maps: dict[str, dict],
    devices: dict[str, list],
    my_name: str,
) -> tuple[dict, list]:
    """Upstream's checks of every worker's device maps and devices, with its
    error texts (``ValueError("Node worker0 has ...")``), then this worker's
    reverse maps (peer -> {its device: ours}) and its device list, as
    TensorPipe computes them at init."""
    backend_registry._validate_device_maps(names, counts, device_maps, devices)
    reverse = backend_registry._create_reverse_mapping(my_name, names, device_maps)
    mine = backend_registry._create_device_list(devices[my_name], device_maps[my_name], reverse)
    return reverse, mine


def register_ordered_effect(qualname: str) -> None:
    """Mark an operator as an ordered side effect for torch.compile: AOT
    autograd threads a token through every call, so a call whose value is
    unused is not eliminated and calls keep their program order."""
    import torch
    from torch._library.effects import EffectType

    torch.library._register_effectful_op(qualname, EffectType.ORDERED)


def assume_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch._dynamo.assume_constant_result, without importing torch._dynamo
    when nothing has yet: that import costs every process that imports
    torch_rpc_ext 1.7 s of its start-up (2 cores), though most never compile.
    On every torch of the range the decorator only sets this attribute
    (torch/_dynamo/decorators.py), which Dynamo reads when it traces a call;
    tests/unit/test_scripting_registry.py checks that the two still agree."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return dynamo.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def unset_fake_mode() -> Any:
    """A context in which tensors are real again (inside a fake impl)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def current_agent() -> Any:
    """The running RPC agent (RuntimeError naming the problem if none)."""
    return api._get_current_rpc_agent()


def update_worker_names(agent: Any) -> None:
    """Keep ``api._ALL_WORKER_NAMES`` (what ``_all_gather`` waits for) equal to
    the current members of a dynamic group."""
    names = {info.name for info in agent.get_worker_infos()}
    with api._all_gather_dict_lock:
        api._ALL_WORKER_NAMES = names


def _our_agent() -> Any:
    """The current agent if it is ours (it has ``is_dynamic``), else None."""
    try:
        agent = api._get_current_rpc_agent()
    except RuntimeError:
        return None
    return agent if hasattr(agent, "is_dynamic") else None


def _is_dynamic_agent() -> bool:
    agent = _our_agent()
    return bool(agent is not None and agent.is_dynamic)


_SHUTDOWN_RREF_WAIT_S = 5.0


# How often rpc.shutdown()'s gather looks at the workers it waits on, and
# how long a probe gives a new connection to one of them to settle.
_GATHER_PROBE_S = 1.0
_GATHER_PROBE_SETTLE_MS = 250


def watched_wait_all_workers(wait_all: Callable[..., Any], agent: Any, *args: Any,
                             **kwargs: Any) -> Any:
    """``api._wait_all_workers`` (the all-gather of a graceful shutdown) for
    a static TORCH_RPC_EXT group, ended with an error when a worker it waits
    on is gone.

    Upstream's gather waits for its signal without a limit under the default
    ``shutdown(timeout=0)``: the leader (the smallest name) for every
    follower's gather, a follower for the leader's broadcast. A worker that
    died (or left without a shutdown) never sends, and the survivors' shutdown
    never returns. So while it waits, a watcher probes each second what this
    worker waits on (the leader: every follower; a follower: the leader)
    through the agent (``_why_unreachable``: a closed connection's reason, or
    a refused or unanswered one; asked twice, so that a connection closing
    as it is probed is dialled again; a worker this one never dialled is
    only knocked on, its listener refusing or not, so that the watch opens
    no connection, channels and all, in the middle of the group's last
    work); once one is gone, it sets the signal
    of this gather (its sequence id only) and the shutdown raises, naming
    it. Probing first and looking at the signal after is what keeps a
    finished gather from being taken for a failed one: a leader gone has
    broadcast to us before it went, a follower cannot finish before the
    leader's broadcast."""
    me = agent.get_worker_info().name
    with api._all_gather_dict_lock:
        names = set(api._ALL_WORKER_NAMES or ())
        # The sequence id the gather about to start takes (as _all_gather
        # makes it): only its state is ever released, not a user's
        # _barrier / _all_gather that another thread may be in. (One that
        # another thread starts on the same names at this very moment would
        # take this id; upstream's own numbering is racy then too.)
        concat = "".join(sorted(names))
        sequence_id = concat + str(api._all_gather_sequence_id.get(concat, 0))
    leader = min(names) if names else me
    waits_on = sorted(names - {me}) if me == leader else [leader]
    stop = threading.Event()
    gone: list[str] = []

    def unreachable() -> list[str]:
        try:
            why = agent._why_unreachable(waits_on, _GATHER_PROBE_SETTLE_MS, dial=False)
            if not any(why):
                return []
            # Once more at once (a connection that closed during the probe
            # is dialled again): only what stays unreachable is gone.
            why = agent._why_unreachable(waits_on, _GATHER_PROBE_SETTLE_MS, dial=False)
        except Exception as e:  # noqa: BLE001 - a probe that fails says nothing
            import logging

            from torch_rpc_ext import logs

            logs._note(
                logging.getLogger(__name__), logging.WARNING,
                "torch_rpc_ext: probing the workers of the shutdown gather failed: %s", e)
            return []
        return [f"{n} ({w})" for n, w in zip(waits_on, why) if w]

    def watch() -> None:
        while not stop.wait(_GATHER_PROBE_S):
            dead = unreachable()
            if not dead:
                continue
            with api._all_gather_dict_lock:
                state = api._all_gather_sequence_id_to_states.get(sequence_id)
            if state is None or state.proceed_signal.is_set():
                continue  # not started (a follower still sending), or done
            gone.extend(dead)
            state.proceed_signal.set()
            return

    watcher = threading.Thread(target=watch, name="rpc_ext-shutdown-gather", daemon=True)
    watcher.start()

    def failed() -> RuntimeError:
        return RuntimeError(
            f"rpc.shutdown on {me}: cannot reach {', '.join(gone)}; the group's "
            "shutdown gather cannot complete without it (after a worker died, "
            "shut down with rpc.shutdown(graceful=False))")

    try:
        result = wait_all(*args, **kwargs)
    except RuntimeError as e:
        # Released by the watcher, the leader's broadcast to the worker gone
        # failed: say who and why. Any other failure is upstream's to tell
        # (its own call to a worker that died, or a broadcast that failed on
        # a live follower, which may have finished and left since: probing
        # now would blame it).
        stop.set()
        watcher.join()
        if gone:
            raise failed() from e
        raise
    finally:
        stop.set()
        watcher.join()
    if gone:
        raise failed()
    return result


def install_shutdown(before_teardown: Callable[[Any], None]) -> None:
    """Make ``rpc.shutdown()`` right for a TORCH_RPC_EXT agent.

    ``api.shutdown`` runs its static path for every agent that is not a
    TensorPipeAgent: ``_wait_all_workers`` (an all-gather across the group,
    which a member leaving alone would wait on forever) and
    ``_delete_all_user_and_unforked_owner_rrefs`` (which waits until every
    peer dropped our RRefs). For a static group the gather is watched
    (``watched_wait_all_workers``: a worker gone ends it with an error
    instead of a hang). For a dynamic member the gather is skipped (it
    leaves alone; ``agent.join(shutdown=True)`` drains its calls and tells
    the group), the RRef wait runs with a bounded wait; and
    ``_finalize_shutdown`` calls ``before_teardown(agent)`` (which stops the
    membership watcher: ``torch_rpc_ext.elastic.stop_membership``) before
    torch tears down its RRef state. All are looked up as module globals
    when ``shutdown`` runs, so wrapping them here is enough; other agents get
    the originals. Idempotent.
    """
    if getattr(api._wait_all_workers, "_torch_rpc_ext", False):
        return
    wait_all = api._wait_all_workers
    delete_all = api._delete_all_user_and_unforked_owner_rrefs

    def _wait_all_workers(*args: Any, **kwargs: Any) -> Any:
        agent = _our_agent()
        if agent is None:
            return wait_all(*args, **kwargs)
        if agent.is_dynamic:
            return None
        return watched_wait_all_workers(wait_all, agent, *args, **kwargs)

    def _delete_all_user_and_unforked_owner_rrefs(*args: Any, **kwargs: Any) -> Any:
        if not _is_dynamic_agent():
            return delete_all(*args, **kwargs)
        from datetime import timedelta

        try:
            return delete_all(timedelta(seconds=_SHUTDOWN_RREF_WAIT_S))
        except RuntimeError as e:
            import logging

            from torch_rpc_ext import logs

            logs._note(
                logging.getLogger(__name__), logging.WARNING,
                "torch_rpc_ext: leaving with RRefs still referenced: %s", e
            )
            return None

    finalize = api._finalize_shutdown

    def _finalize_shutdown(*args: Any, **kwargs: Any) -> Any:
        # torch tears down its RRef state before the agent's shutdown: our
        # membership watcher, which releases departed members' forks there,
        # stops first (a graceful leave has stopped it already).
        if _is_dynamic_agent():
            before_teardown(api._get_current_rpc_agent())
        return finalize(*args, **kwargs)

    _wait_all_workers._torch_rpc_ext = True  # type: ignore[attr-defined]
    api._wait_all_workers = _wait_all_workers
    api._finalize_shutdown = _finalize_shutdown
    api._delete_all_user_and_unforked_owner_rrefs = _delete_all_user_and_unforked_owner_rrefs
