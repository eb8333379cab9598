# SPDX-License-Identifier: BSD-3-Clause
"""Every thread the agent starts names itself after its role ("rpcx-..."),
as `top -H`, `ps -L`, perf, gdb and py-spy show it. Before, each read
"python", inherited from the interpreter's thread that started it, so a
profile of a worker could not tell the transport loop from the pool, the
completion thread or torch's own threads (docs/architecture.md, "Threads")."""

import os
import time

import pytest
import torch
from torch.distributed import rpc

from tests.rpc.world import init, run_world

pytestmark = pytest.mark.timeout(120)

# What every worker runs once init_rpc returns and a call has gone each way:
# each transport's loop and its monitor, the request pool and its
# supervisor, the completion thread and its supervisor, the call timeouts.
ROLES = {"rpcx-shm", "rpcx-shm-mon", "rpcx-tcp", "rpcx-tcp-mon", "rpcx-pool",
         "rpcx-pool-sup", "rpcx-complete", "rpcx-complete-s", "rpcx-timeouts"}
# Loop threads that lost the lead and wait to lead again.
SPARES = {"rpcx-shm-spare", "rpcx-tcp-spare"}


def threads() -> dict[int, str]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except FileNotFoundError:  # (exited meanwhile)
            pass
    return out


def started_by_init(rank, world_size):
    before = threads()
    init(rank, world_size)
    peer = f"worker{1 - rank}"
    rpc.rpc_sync(peer, torch.add, args=(torch.ones(1), 1))
    rpc.api._barrier(["worker0", "worker1"])
    # A loop thread that lost the lead (a request that ran 2 ms on a slow
    # machine, or one that made a call) may still be finishing its piece;
    # once it ends, it parks as "rpcx-<transport>-spare" or exits.
    deadline = time.monotonic() + 30
    while True:
        after = threads()
        names = list(after.values())
        if names.count("rpcx-shm") == 1 and names.count("rpcx-tcp") == 1:
            break
        if time.monotonic() > deadline:
            break  # the assertions below say which
        time.sleep(0.01)
    rpc.shutdown()
    return {"new": sorted(name for tid, name in after.items() if tid not in before),
            "main": after[os.getpid()]}


def test_every_thread_of_ours_is_named_after_its_role():
    for result in run_world(started_by_init, 2).values():
        new = result["new"]
        assert ROLES <= set(new), new
        ours = [n for n in new if n.startswith("rpcx-")]
        # num_worker_threads of the tests' options (4), not the default (16).
        # A task no thread took within 20 ms adds one more, for 5 s
        # (thread_pool.cpp): a loaded host does that now and then.
        assert 4 <= ours.count("rpcx-pool") < 16, new
        # One leader a loop; ex-leaders wait as named spares, two at most.
        assert ours.count("rpcx-shm") == 1 and ours.count("rpcx-tcp") == 1, new
        assert ours.count("rpcx-shm-spare") <= 2, new
        assert ours.count("rpcx-tcp-spare") <= 2, new
        loops = {n for n in ours if n.startswith(("rpcx-shm", "rpcx-tcp"))}
        assert loops <= ROLES | SPARES, new
        # Nothing we start inherits the interpreter's name: the one new
        # thread that does is torch's (the base RpcAgent's retry thread,
        # RpcAgent::retryExpiredRpcs, which its start() spawns).
        assert new.count(result["main"]) <= 1, new
