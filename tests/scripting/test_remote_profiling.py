# SPDX-License-Identifier: BSD-3-Clause
"""The callee's work in the caller's torch.profiler (Kineto) trace: an
rpc_sync of a function doing known work, exported as a Chrome trace, shows
the caller's encode/send spans, and on a track named after the remote
worker the wait, the callee's record_function range and operators inside
it, and the decode."""

import json

import pytest
import torch
from torch.distributed import rpc

from tests.rpc.world import init, run_world
from torch_rpc_ext import scripting

pytestmark = pytest.mark.timeout(120)


def remote_block(n):
    with torch.autograd.profiler.record_function("remote_block"):
        a = torch.ones(n, n)
        return (a @ a).sum()


def profiled_calls(rank, world_size, trace_dir):
    init(rank, world_size)
    out = {}
    if rank == 1:
        scripting.register("remote_block", remote_block)
    rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), 1))
    if rank == 0:
        rpc.rpc_sync("worker1", remote_block, args=(8,))  # connected, warm
        with torch.profiler.profile() as prof:
            out["udf"] = rpc.rpc_sync("worker1", remote_block, args=(96,))
        prof.export_chrome_trace(f"{trace_dir}/udf.json")
        with torch.profiler.profile() as prof:
            out["named"] = scripting.rpc_sync("worker1", "remote_block", 96)
        prof.export_chrome_trace(f"{trace_dir}/named.json")
        # Not profiled: an ordinary call after the profiler has stopped.
        out["after"] = rpc.rpc_sync("worker1", remote_block, args=(4,))
    rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), 1))
    rpc.shutdown()
    return out


def spans(trace_path):
    events = json.load(open(trace_path))["traceEvents"]
    names = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    by_name = {}
    for e in events:
        if e.get("ph") == "X":
            by_name.setdefault(e["name"], []).append(e)
    return names, by_name


@pytest.mark.parametrize("trace", ["udf", "named"])
def test_callee_events_on_the_remote_workers_track_inside_the_wait(tmp_path, trace):
    out = run_world(profiled_calls, 2, timeout=90, trace_dir=str(tmp_path))[0]
    assert float(out["udf"]) == float(out["named"]) == 96.0**3
    assert float(out["after"]) == 4.0**3
    threads, by_name = spans(tmp_path / f"{trace}.json")
    (encode,) = by_name["torch_rpc_ext::encode"]
    (send,) = by_name["torch_rpc_ext::send"]
    (wait,) = by_name["torch_rpc_ext::wait"]
    (decode,) = by_name["torch_rpc_ext::decode"]
    (block,) = by_name["remote_block"]
    # Caller spans on the calling thread; remote ones on "rpc:worker1".
    assert threads[encode["tid"]] == threads[send["tid"]]
    assert "rpc:worker1" not in threads[encode["tid"]]
    remote_track = block["tid"]
    assert "(rpc:worker1)" in threads[remote_track]
    assert wait["tid"] == decode["tid"] == remote_track
    assert block["args"]["Backend"] == "torch_rpc_ext:worker1"
    # The callee's range inside the caller's wait, and its matmul inside it.
    assert wait["ts"] <= block["ts"]
    assert block["ts"] + block["dur"] <= wait["ts"] + wait["dur"]
    mm = [e for e in by_name["aten::mm"] if e["tid"] == remote_track]
    assert len(mm) == 1
    assert block["ts"] <= mm[0]["ts"] <= mm[0]["ts"] + mm[0]["dur"] <= block["ts"] + block["dur"]
    assert decode["ts"] >= wait["ts"] + wait["dur"]
    # Clock offset as NTP estimates it from the trace (one host, one clock):
    # the callee's work sits in the middle of the wait, within 1 ms.
    remote = [
        e for e in sum(by_name.values(), [])
        if e["tid"] == remote_track and not e["name"].startswith("torch_rpc_ext::")
    ]
    first = min(e["ts"] for e in remote)
    last = max(e["ts"] + e["dur"] for e in remote)
    offset_us = ((first - wait["ts"]) + (last - (wait["ts"] + wait["dur"]))) / 2
    assert abs(offset_us) < 1000, offset_us
