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

CALLS = 5  # profiled calls per trace


def remote_block(n):
    with torch.autograd.profiler.record_function("remote_block"):
        a = torch.ones(n, n)
        return (a @ a).sum()


def profiled_calls(rank, world_size, trace_dir):
    out = {}
    if rank == 1:
        scripting.register("remote_block", remote_block)
    init(rank, world_size)
    rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), 1))
    if rank == 0:
        rpc.rpc_sync("worker1", remote_block, args=(8,))  # connected, warm
        with torch.profiler.profile() as prof:
            for _ in range(CALLS):
                out["udf"] = rpc.rpc_sync("worker1", remote_block, args=(96,))
        prof.export_chrome_trace(f"{trace_dir}/udf.json")
        with torch.profiler.profile() as prof:
            for _ in range(CALLS):
                out["named"] = scripting.rpc_sync("worker1", "remote_block", 96)
        prof.export_chrome_trace(f"{trace_dir}/named.json")
        # Not profiled: an ordinary call after the profiler has stopped.
        out["after"] = rpc.rpc_sync("worker1", remote_block, args=(4,))
    rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), 1))
    rpc.shutdown()
    return out


def spans(trace_path):
    events = json.load(open(trace_path))["traceEvents"]
    # A thread id can carry two names: Kineto may also give one thread the
    # name of the thread that wrote the trace (docs/profiling.md, Limits).
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names.setdefault(e["tid"], set()).add(e["args"]["name"])
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
    for name in ("encode", "send", "wait", "decode"):
        assert len(by_name[f"torch_rpc_ext::{name}"]) == CALLS, name
    assert len(by_name["remote_block"]) == CALLS
    caller_track = by_name["torch_rpc_ext::encode"][0]["tid"]
    remote_track = by_name["remote_block"][0]["tid"]
    # Caller spans on the calling thread; remote ones on "rpc:worker1".
    assert not any("rpc:worker1" in n for n in threads[caller_track])
    assert f"thread {remote_track} (rpc:worker1)" in threads[remote_track]
    for name in ("encode", "send"):
        assert {e["tid"] for e in by_name[f"torch_rpc_ext::{name}"]} == {caller_track}
    for name in ("torch_rpc_ext::wait", "torch_rpc_ext::decode", "remote_block"):
        assert {e["tid"] for e in by_name[name]} == {remote_track}
    assert {e["args"]["Backend"] for e in by_name["remote_block"]} == {"torch_rpc_ext:worker1"}

    def inside(e, outer):
        return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]

    remote = [
        e for e in sum(by_name.values(), [])
        if e["tid"] == remote_track and not e["name"].startswith("torch_rpc_ext::")
    ]
    waits = sorted(by_name["torch_rpc_ext::wait"], key=lambda e: e["ts"])
    decodes = sorted(by_name["torch_rpc_ext::decode"], key=lambda e: e["ts"])
    samples = []
    for wait, decode in zip(waits, decodes):
        # Each call: its remote_block inside its wait, its matmul inside
        # that, then its decode.
        (block,) = [b for b in by_name["remote_block"] if inside(b, wait)]
        (mm,) = [e for e in by_name["aten::mm"] if e["tid"] == remote_track and inside(e, block)]
        assert decode["ts"] >= wait["ts"] + wait["dur"]
        mine = [e for e in remote if inside(e, wait)]
        first = min(e["ts"] for e in mine)
        last = max(e["ts"] + e["dur"] for e in mine)
        offset = ((first - wait["ts"]) + (last - (wait["ts"] + wait["dur"]))) / 2
        samples.append((wait["dur"] - (last - first), offset))
    # Clock offset as NTP estimates it from the trace (one host, one clock),
    # from the call with the shortest round trip: within 1 ms.
    _, offset_us = min(samples)
    assert abs(offset_us) < 1000, samples


def raises():
    raise ValueError("no")


def sleeps(s):
    import time

    time.sleep(s)


def failed_calls(rank, world_size, trace_dir):
    out = {}
    init(rank, world_size)
    if rank == 0:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))  # connected
        with torch.profiler.profile() as prof:
            try:
                rpc.rpc_sync("worker1", raises)
            except ValueError as e:
                out["raised"] = str(e)
            try:
                rpc.rpc_sync("worker1", sleeps, args=(3,), timeout=0.3)
            except RuntimeError as e:
                out["timed_out"] = str(e)
        prof.export_chrome_trace(f"{trace_dir}/failed.json")
    rpc.shutdown()
    return out


def test_a_profiled_call_that_fails_or_times_out_still_shows_its_wait(tmp_path):
    """A call that raised remotely, and one that timed out: no remote
    events came back, but the caller waited. Before (a helper's reading in
    session 94) their traces showed only encode and send."""
    out = run_world(failed_calls, 2, timeout=90, trace_dir=str(tmp_path))[0]
    assert "no" in out["raised"] and "timeout" in out["timed_out"]
    _, by_name = spans(tmp_path / "failed.json")
    assert len(by_name["torch_rpc_ext::encode"]) == 2
    waits = sorted(by_name["torch_rpc_ext::wait"], key=lambda e: e["ts"])
    assert len(waits) == 2, waits
    assert waits[1]["dur"] >= 250_000  # the timeout's 0.3 s, in us
