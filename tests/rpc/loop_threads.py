# SPDX-License-Identifier: BSD-3-Clause
"""The shm transport loop's threads as a worker sees them, for tests that
count them (loop hand-offs, spares, OpenMP teams)."""

import os
import time

from torch.distributed import rpc


def shm_loop_threads():
    """The names of this process's shm loop threads, its monitor aside.
    (Quick: a piece that ran 2 ms would have its loop taken over.)"""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # exited meanwhile (ENOENT, or ESRCH mid-read)
            pass
    return sorted(n for n in names if n.startswith("rpcx-shm") and n != "rpcx-shm-mon")


def loop_threads_once_parked(to):
    """`to`'s shm loop threads by name, asked until an ex-leader still
    finishing its piece has parked (one "rpcx-shm" left; 30 s at most: a
    loaded host may leave it descheduled)."""
    deadline = time.monotonic() + 30
    while True:
        names = rpc.rpc_sync(to, shm_loop_threads)
        if names.count("rpcx-shm") == 1 or time.monotonic() > deadline:
            return names
        time.sleep(0.01)
