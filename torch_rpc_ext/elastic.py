# SPDX-License-Identifier: BSD-3-Clause
"""Dynamic groups as the program sees them (docs/elastic.md).

``init_rpc(name, rank=r, backend=TORCH_RPC_EXT)`` without ``world_size``
joins a running group (or starts one); ``rpc.shutdown()`` leaves it; a member
that dies is declared dead by the others once its lease runs out. This
module reads the membership and runs callbacks as it changes::

    import torch_rpc_ext

    def changed(event):
        print(event.kind, event.name, event.epoch)  # "join" / "leave" / "dead"

    torch_rpc_ext.on_membership_change(changed)
    epoch, members = torch_rpc_ext.membership()
"""

import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from torch_rpc_ext import _torch_private, logs

__all__ = [
    "Member",
    "MembershipEvent",
    "membership",
    "on_membership_change",
    "remove_membership_callback",
]

_log = logging.getLogger(__name__)


class Member(NamedTuple):
    name: str
    rank: int
    # Random per join: a later holder of the same name and rank has another.
    incarnation: int


class MembershipEvent(NamedTuple):
    kind: str  # "join", "leave" or "dead"
    epoch: int  # the membership log's index of the change
    name: str
    rank: int
    incarnation: int
    reason: str  # for "dead": why the member was declared dead


class Membership(NamedTuple):
    epoch: int
    members: list[Member]


_callbacks: list[Callable[[MembershipEvent], Any]] = []
_callbacks_lock = threading.Lock()
# The event thread of each live dynamic agent, by id(agent).
_event_threads: dict[int, threading.Thread] = {}
# rpc.shutdown() waits this long at most for callbacks still running.
_CALLBACK_DRAIN_S = 10.0


def membership() -> Membership:
    """The current members of this worker's group and the epoch of that view.

    A static group reports epoch 0 and its ``world_size`` members, with
    incarnation 0.
    """
    agent = _torch_private.current_agent()
    epoch, members = agent._membership()
    return Membership(epoch, [Member(*m) for m in members])


def on_membership_change(fn: Callable[[MembershipEvent], Any]) -> Callable:
    """Call ``fn(event)`` for each join, leave and death this worker applies
    after its own join, once per event, in epoch order, on one thread of its
    own (not the caller's; a slow callback delays later ones only). The last
    event is this worker's own leave (on a graceful ``rpc.shutdown()``, which
    returns once the callbacks for every event up to it have run, waiting
    10 s at most) or its own death (declared by the others: it is fenced);
    a worker that is no longer a member sees no more. May
    be used as a decorator; callbacks registered before ``init_rpc`` apply
    to every later group. Returns ``fn``."""
    with _callbacks_lock:
        _callbacks.append(fn)
    return fn


def remove_membership_callback(fn: Callable[[MembershipEvent], Any]) -> None:
    with _callbacks_lock:
        _callbacks.remove(fn)


def start_event_thread(agent: Any) -> threading.Thread:
    """For a dynamic agent: apply membership events to torch's RPC state
    (the names ``_all_gather`` and shutdown use) and run the callbacks, until
    the agent shuts down."""

    def run() -> None:
        while True:
            events = agent._take_membership_events(0.5)
            if events is None:
                return
            for raw in events:
                event = MembershipEvent(*raw)
                try:
                    _torch_private.update_worker_names(agent)
                except Exception:
                    logs._note(_log, logging.ERROR, "torch_rpc_ext: updating the worker names failed",
                               exc_info=True)
                with _callbacks_lock:
                    callbacks = list(_callbacks)
                for fn in callbacks:
                    try:
                        fn(event)
                    except Exception:
                        logs._note(_log, logging.ERROR,
                                   "torch_rpc_ext: membership callback %r failed", fn,
                                   exc_info=True)

    thread = threading.Thread(target=run, name="torch_rpc_ext-membership", daemon=True)
    thread.start()
    _event_threads[id(agent)] = thread
    return thread


def stop_membership(agent: Any) -> None:
    """At ``rpc.shutdown()``, before torch tears down its RRef state
    (``_torch_private.install_shutdown``): stop the membership
    watcher, which releases departed members' forks there, then let the
    callbacks see every event up to this worker's own leave while torch's
    RPC state is still up."""
    agent._stop_membership()
    drain_event_thread(agent)


def drain_event_thread(agent: Any) -> None:
    """After the agent stopped its membership watcher (no event follows):
    wait until the callbacks for the events already applied have run, its
    own leave among them, so that they are not cut off by the process
    exiting right after ``rpc.shutdown()``."""
    thread = _event_threads.pop(id(agent), None)
    if thread is None or thread is threading.current_thread():
        return  # shutdown called from a callback: it runs the rest itself
    thread.join(_CALLBACK_DRAIN_S)
    if thread.is_alive():
        logs._note(
            _log, logging.WARNING,
            "torch_rpc_ext: membership callbacks still running %.0f s into "
            "rpc.shutdown(); not waiting for them",
            _CALLBACK_DRAIN_S,
        )
