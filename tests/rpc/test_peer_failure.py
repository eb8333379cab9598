# SPDX-License-Identifier: BSD-3-Clause
"""A peer killed with SIGKILL mid-call: pending calls fail at once (not at
rpc_timeout) naming the peer, new calls fail fast, survivors keep working."""

import os
import signal
import threading
import time

import pytest
import torch
from torch.distributed import rpc

from tests.rpc.world import init, run_world

pytestmark = pytest.mark.timeout(120)


def slow(seconds):
    time.sleep(seconds)
    return seconds


def die_in(seconds):
    threading.Timer(seconds, os.kill, args=(os.getpid(), signal.SIGKILL)).start()
    return os.getpid()


def scenario(rank, world_size):
    init(rank, world_size, rpc_timeout=60)
    out = {}
    if rank == 0:
        pending = [rpc.rpc_async("worker1", slow, args=(30,)) for _ in range(3)]
        rpc.rpc_sync("worker1", die_in, args=(0.5,))
        t0 = time.monotonic()
        errors = []
        for fut in pending:
            try:
                fut.wait()
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        out["detect_s"] = time.monotonic() - t0
        out["pending_errors"] = errors
        t0 = time.monotonic()
        try:
            rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
        except RuntimeError as e:
            out["new_call_error"] = str(e)
        out["new_call_s"] = time.monotonic() - t0
        out["survivor"] = rpc.rpc_sync("worker2", torch.add, args=(torch.ones(1), 41)).item()
        out["errors_metric"] = int(
            rpc.api._get_current_rpc_agent().get_metrics()["rpc_ext.peer.worker1.errors"]
        )
    if rank == 1:
        time.sleep(60)  # serve until worker0 has us SIGKILLed
    if rank == 2:
        # Stay up until worker0 is done with us, then leave with it.
        out["from_0"] = rpc.rpc_sync("worker0", torch.add, args=(torch.ones(1), 1)).item()
        time.sleep(2)
    rpc.shutdown(graceful=False)
    return out


def test_sigkilled_peer_fails_pending_calls_promptly_and_survivors_continue():
    out = run_world(scenario, world_size=3, dies=frozenset({1}), timeout=90)[0]
    assert out["detect_s"] < 5, out["detect_s"]  # rpc_timeout is 60 s
    for err in out["pending_errors"]:
        assert err is not None and "worker1" in err
        assert "lost" in err or "closed" in err
    assert "worker1" in out["new_call_error"]
    assert out["new_call_s"] < 5
    assert out["survivor"] == 42.0
    assert out["errors_metric"] >= 3


def freeze_in(seconds):
    threading.Timer(seconds, os.kill, args=(os.getpid(), signal.SIGSTOP)).start()
    return os.getpid()


def frozen(rank, world_size):
    # A frozen (SIGSTOPped) peer keeps its sockets open: only the heartbeat
    # can tell it from a slow one.
    init(rank, world_size, rpc_timeout=60, heartbeat_timeout=2)
    out = {}
    if rank == 0:
        pending = [rpc.rpc_async("worker1", slow, args=(30,)) for _ in range(2)]
        pid = rpc.rpc_sync("worker1", freeze_in, args=(0.5,))
        t0 = time.monotonic()
        out["errors"] = []
        for fut in pending:
            try:
                fut.wait()
                out["errors"].append(None)
            except RuntimeError as e:
                out["errors"].append(str(e))
        out["detect_s"] = time.monotonic() - t0
        os.kill(pid, signal.SIGKILL)
    else:
        time.sleep(60)
    rpc.shutdown(graceful=False)
    return out


def test_frozen_peer_is_detected_by_the_heartbeat():
    out = run_world(frozen, dies=frozenset({1}), timeout=60)[0]
    # Frozen after 0.5 s, declared dead 2-2.4 s later; rpc_timeout is 60 s.
    assert 2.0 <= out["detect_s"] < 6, out["detect_s"]
    for err in out["errors"]:
        assert err is not None and "worker1" in err and "heartbeat" in err, err


def shutdown_with_a_dead_peer(rank, world_size):
    init(rank, world_size, rpc_timeout=5)
    if rank == 1:
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2.5)  # worker1 is gone
    t0 = time.monotonic()
    err = None
    try:
        rpc.shutdown(graceful=True, timeout=5)
    except RuntimeError as e:
        err = str(e)
    elapsed = time.monotonic() - t0
    if rank == 0:
        time.sleep(5)  # we host the store: stay until worker2 is done with it
    return {"seconds": elapsed, "error": err}


def test_graceful_shutdown_with_a_dead_peer_raises_within_its_timeout():
    out = run_world(shutdown_with_a_dead_peer, world_size=3, dies=frozenset({1}), timeout=90)
    for rank in (0, 2):
        # Raises, naming the dead worker, instead of waiting for it forever.
        assert out[rank]["seconds"] < 15, out
        assert out[rank]["error"] is not None and "worker1" in out[rank]["error"], out
