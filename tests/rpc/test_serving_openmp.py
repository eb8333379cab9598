# SPDX-License-Identifier: BSD-3-Clause
"""A Python UDF running torch's intra-op parallel work on a transport loop
thread: the loop's threads take turns serving such calls (each hands the
loop on after 2 ms), and only the one serving keeps an OpenMP team
(csrc/common/openmp_pool.h). With a team kept per ex-server, libgomp
manages more threads than CPUs and sleeps its workers after every op: a
`heavy` call on 4 MB went from 11 to 18-23 ms here (docs/performance.md)."""

import ctypes
import threading
import time

import pytest
import torch
from torch.distributed import rpc

from tests.rpc.loop_threads import loop_threads_once_parked
from tests.rpc.world import init, run_world

pytestmark = pytest.mark.timeout(180)


def _libgomp_loaded():
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read() and hasattr(ctypes.CDLL(None), "omp_pause_resource_all")
    except OSError:
        return False


def parallel_ops(ms):
    # Intra-op parallel work (torch's OpenMP, two threads) for `ms` ms on
    # the serving thread: long enough for the loop's monitor to hand the
    # loop to another thread while it runs.
    torch.set_num_threads(2)
    x = torch.ones(1 << 20)
    end = time.monotonic() + ms / 1000
    while time.monotonic() < end:
        x.mul_(1.0)
    return threading.get_native_id()


def serve_parallel_calls(rank, world_size, calls):
    init(rank, world_size, rpc_timeout=60)
    out = {}
    if rank == 0:
        out["servers"] = [rpc.rpc_sync("worker1", parallel_ops, args=(60,)) for _ in range(calls)]
        # Once the ex-leader finishing the last call has parked, the leader
        # is the one "rpcx-shm" left, unless a parked thread
        # ("rpcx-shm-spare") kept its team, whose workers took the name of
        # the thread that made them.
        out["names"] = loop_threads_once_parked("worker1")
    rpc.shutdown()
    return out


@pytest.mark.skipif(not _libgomp_loaded(), reason="torch's OpenMP here is not GNU libgomp")
def test_only_the_serving_loop_thread_keeps_an_openmp_team():
    r = run_world(serve_parallel_calls, 2, timeout=150, calls=6)[0]
    # The loop's threads took turns serving (each call handed the loop on);
    # with one thread serving all, there would be one team either way.
    assert len(set(r["servers"])) >= 2, r["servers"]
    # No parked thread keeps its team's workers (named "rpcx-shm" after the
    # thread that made them): without the release, two teams' workers
    # stayed, three "rpcx-shm" threads at least.
    assert r["names"].count("rpcx-shm") == 1, r["names"]
