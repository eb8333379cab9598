# SPDX-License-Identifier: BSD-3-Clause
"""FAULTY_TORCH_RPC_EXT (torch_rpc_ext.testing): the options upstream's faulty
fixture uses, bad names refused at init, intentional failures typed so that
upstream's retrying senders retry them, delays that do not block callers, and
a held-back call that times out before it is written returned already failed.
Upstream's own FAULTY_AGENT_TESTS run in tests/faulty."""

import threading
import time

import pytest
import torch
from torch.distributed import rpc

import torch_rpc_ext.testing as faulty
from tests.rpc.world import run_world

pytestmark = pytest.mark.timeout(120)


def test_options_are_those_of_upstreams_faulty_fixture():
    backend = rpc.backend_registry.BackendType[faulty.FAULTY_BACKEND_NAME]
    opts = rpc.backend_registry.construct_rpc_backend_options(
        backend,
        init_method="env://",
        num_worker_threads=8,
        num_fail_sends=3,
        messages_to_fail=["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT",
                          "RREF_USER_DELETE", "CLEANUP_AUTOGRAD_CONTEXT_REQ"],
        messages_to_delay={"PYTHON_CALL": 1.5, "SCRIPT_CALL": 1.5},
    )
    assert isinstance(opts, faulty.FaultyRpcExtBackendOptions)
    assert opts.num_worker_threads == 8 and opts.num_fail_sends == 3
    assert len(opts.messages_to_fail) == 4 and len(opts.messages_to_delay) == 2
    assert opts.rpc_timeout == rpc.constants.DEFAULT_RPC_TIMEOUT_SEC
    with pytest.raises(ValueError, match="num_fail_sends"):
        faulty.FaultyRpcExtBackendOptions(num_fail_sends=-1)
    with pytest.raises(ValueError, match="SCRIPT_CALL"):
        faulty.FaultyRpcExtBackendOptions(messages_to_delay={"SCRIPT_CALL": -1})
    # A delay that never ends, and one name where a list of them belongs (it
    # was split into letters, and the agent named the letter 'S').
    with pytest.raises(ValueError, match="SCRIPT_CALL.*finite"):
        faulty.FaultyRpcExtBackendOptions(messages_to_delay={"SCRIPT_CALL": float("inf")})
    with pytest.raises(ValueError, match="messages_to_fail must be a sequence"):
        faulty.FaultyRpcExtBackendOptions(messages_to_fail="SCRIPT_CALL")


def _init(rank, world_size, **faults):
    rpc.init_rpc(
        f"worker{rank}", rank=rank, world_size=world_size,
        backend=rpc.backend_registry.BackendType[faulty.FAULTY_BACKEND_NAME],
        rpc_backend_options=faulty.FaultyRpcExtBackendOptions(
            address="127.0.0.1", rpc_timeout=30, **faults),
    )


def unknown_name(rank, world_size):
    try:
        _init(rank, world_size, messages_to_fail=["NOT_A_MESSAGE"])
    except ValueError as e:
        return str(e)
    rpc.shutdown()
    return None


def test_unknown_message_type_is_refused_at_init():
    err = run_world(unknown_name, world_size=1)[0]
    assert err is not None and "NOT_A_MESSAGE" in err


def failures_and_delays(rank, world_size):
    _init(rank, world_size, num_fail_sends=2,
          messages_to_fail=["SCRIPT_CALL"], messages_to_delay={"PYTHON_CALL": 2})
    out = {}
    if rank == 0:
        args = (torch.ones(2), 1)
        errors = []
        for _ in range(3):  # the same message fails twice, then goes through
            try:
                errors.append(rpc.rpc_sync("worker1", torch.add, args=args).sum().item())
            except RuntimeError as e:
                errors.append(str(e))
        out["attempts"] = errors
        t0 = time.monotonic()
        fut = rpc.rpc_async("worker1", max, args=(3, 4))
        out["returned_after"] = time.monotonic() - t0
        out["value"] = fut.wait()
        out["completed_after"] = time.monotonic() - t0
        fut = rpc.rpc_async("worker1", max, args=(3, 4), timeout=0.5)
        try:
            fut.wait()
        except RuntimeError as e:
            out["timeout_error"] = str(e)
    rpc.shutdown()
    return out


def test_intentional_failures_then_success_and_non_blocking_delays():
    out = run_world(failures_and_delays)[0]
    first, second, third = out["attempts"]
    assert "intentionally" in first and "intentionally" in second
    assert third == 4.0
    assert out["returned_after"] < 1.0  # held back on the pool, not the caller
    assert out["value"] == 4 and out["completed_after"] >= 2.0
    assert "RPC ran for more than" in out["timeout_error"]


@torch.jit.script
def _double(t: torch.Tensor) -> torch.Tensor:
    return t + t


def timed_out_while_held(rank, world_size):
    # Only one RRef may fail per process: upstream's RRef::handleError keeps
    # the handlers of the first RRef it saw (a function-local static that
    # captures `this`).
    _init(rank, world_size, messages_to_delay={"PYTHON_CALL": 2, "SCRIPT_REMOTE_CALL": 2})
    out = {}
    t0 = time.monotonic()
    fut = rpc.rpc_async("worker0", max, args=(3, 4), timeout=0.3)
    out["returned_after"] = time.monotonic() - t0
    out["done_on_return"] = fut.done()
    try:
        fut.wait()
    except RuntimeError as e:
        out["error"] = str(e)
    # upstream's _test_remote_message_delay_timeout to self, without the
    # race: the creation future must have failed, and the OwnerRRef been
    # marked timed out, before rpc.remote() returns. Otherwise to_here()
    # waits for a value that never comes (the late request finds the
    # OwnerRRef gone), so it runs on a thread given 10 s.
    rref = rpc.remote("worker0", _double, args=(torch.ones(1),), timeout=0.3)
    out["remote_done_on_return"] = rref._get_future().done()

    def to_here():
        try:
            out["to_here"] = rref.to_here()
        except RuntimeError as e:
            out["to_here"] = str(e)

    t = threading.Thread(target=to_here, daemon=True)
    t.start()
    t.join(10)
    out.setdefault("to_here", "still waiting after 10 s")
    rpc.shutdown()
    return out


def test_call_timing_out_while_held_back_is_returned_failed():
    out = run_world(timed_out_while_held, world_size=1)[0]
    assert out["done_on_return"], out
    assert 0.3 <= out["returned_after"] < 1.5, out
    assert "RPC ran for more than set timeout (300 ms)" in out["error"], out
    assert out["remote_done_on_return"], out
    assert "RRef creation via rpc.remote() timed out" in out["to_here"], out
