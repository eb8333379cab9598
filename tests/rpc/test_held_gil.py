# SPDX-License-Identifier: BSD-3-Clause
"""Pipelined builtin and TorchScript calls sent by a user's thread complete
under one hold of the GIL (calls.cpp, completeHoldingGil; the counts are
test_fast_path.py's). What torch's completion does in that hold must not
need the GIL free."""

import pytest
import torch
from torch.distributed import rpc
from torch.distributed.rpc import RRef

from tests.rpc.world import init, run_world

pytestmark = pytest.mark.timeout(180)


@torch.jit.script
def return_rref(r: RRef[torch.Tensor]) -> RRef[torch.Tensor]:
    return r


def held_completions():
    m = rpc.api._get_current_rpc_agent().get_metrics()
    return int(m["rpc_ext.completions.held_gil"])


def rrefs_returned_in_a_burst(rank, world_size):
    init(rank, world_size)
    out = {}
    if rank == 0:
        ours = rpc.remote("worker0", torch.add, args=(torch.ones(2), 1))
        theirs = rpc.remote("worker1", torch.add, args=(torch.ones(2), 2))
        before = held_completions()
        # In flight together, so they complete on the completion thread,
        # held: each response is an RRef, whose type torch's unpickler
        # resolves through the agent's type resolver, which asserts the GIL
        # is free (PythonRpcHandler::getInstance()).
        futs = [rpc.rpc_async("worker1", return_rref, args=(r,))
                for _ in range(20) for r in (ours, theirs)]
        out["values"] = [f.wait().to_here().tolist() for f in futs]
        out["held"] = held_completions() - before
    rpc.shutdown()
    return out


def test_rrefs_returned_by_pipelined_torchscript_calls_complete():
    # (Before the resolver let the GIL go in a hold, the first such
    # completion threw torch's assertion on the completion thread and its
    # future never completed: the ranks did not finish.)
    r = run_world(rrefs_returned_in_a_burst, 2, timeout=90)[0]
    assert r["values"] == [[2.0, 2.0], [3.0, 3.0]] * 20, r
    assert r["held"] > 0, r
