# SPDX-License-Identifier: BSD-3-Clause
"""The transport loop runs requests and completions without a thread hop, and
hands itself to a new thread when such work blocks (tcp/loop.h)."""

import subprocess
import sys

import pytest

from torch_rpc_ext import _testing


@pytest.mark.parametrize("n", [2, 5, 32])
def test_blocking_deferred_work_cannot_stall_the_loop(n):
    # Piece i waits for piece i+1, which is queued behind it on the same
    # thread: without the takeover this is a deadlock.
    finished, takeovers, outside = _testing.loop_chain(n, 20.0)
    assert finished
    assert takeovers >= n - 1
    # Deferred work is not "in the loop": it must not touch loop-only state.
    assert outside


def test_work_that_does_not_block_needs_no_takeover():
    # A piece the scheduler holds off its CPU for kTakeoverAfter (2 ms) is
    # taken over as one that blocks, as it should be (the loop has waited
    # that long), and a loaded 2-core host does that now and then: CI saw
    # one takeover here. A loop that took over work that does not block
    # would do so in every run.
    runs = []
    for _ in range(20):
        finished, takeovers, _ = _testing.loop_chain(1, 5.0)
        assert finished
        runs.append(takeovers)
        if takeovers == 0:
            break
    assert runs[-1] == 0, runs


@pytest.mark.parametrize("sleep_ms", [0, 30])
def test_stop_runs_deferred_work_instead_of_dropping_it(sleep_ms):
    # Deferred work carries completions of client calls; dropping it would
    # leave a caller waiting forever.
    assert _testing.loop_stop_runs_deferred(8, sleep_ms) == 8


def test_an_endpoint_dropped_without_close_stops_its_loop():
    """Its destructor stops the loop, whose threads take the GIL on their way
    out (python_threads.cpp): run with the GIL held, the two waited on each
    other for good. A test whose worker failed with its Endpoint in the
    traceback hung there until the watchdog (CI once waited out the test's
    240 s). In a process of its own: a deadlock must not take pytest's."""
    code = (
        "from torch_rpc_ext import _testing\n"
        "ep = _testing.Endpoint(0, 2, b'k' * 32, 'shm', [])\n"
        "assert ep.address\n"
        "del ep\n"
        "print('dropped')\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("dropping the Endpoint hung")
    assert out.returncode == 0 and out.stdout.strip() == "dropped", out.stderr
