# SPDX-License-Identifier: BSD-3-Clause
"""Where a small call's threads run: blocks of rpc_sync builtin calls on
TORCH_RPC_EXT, each block's median beside every busy thread's vCPU, run
time, run-queue wait and context switches per call, both processes (from
/proc/<pid>/task/<tid>/schedstat and status).

docs/performance.md, "Interleaved blocks, and what the two speeds are":
on a 2-vCPU machine a block is fast or slow by where three threads (the
caller's Python thread and loop, the callee's loop) land. --pin puts each
process on a vCPU of its own (sched_setaffinity before init_rpc), an
experiment, not an option of ours. --poll-on-caller-cpu on|off sets the
option that fixes the arrangement (docs/performance.md, "The poll on the
caller's CPU"; on by default on two vCPUs).

  python benchmarks/small_call_placement.py --blocks 14 [--pin] [--poll-on-caller-cpu off]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # a source checkout works without installing
from _harness import emit, run_world, timed  # noqa: E402
from rpc_bench import _init  # noqa: E402


def threads_of(pid):
    """{name:tid: (vcpu, run ns, wait ns, voluntary, involuntary)}."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            stat = open(f"{base}/stat").read()
            name = open(f"{base}/comm").read().strip()
            run, wait, _ = map(int, open(f"{base}/schedstat").read().split())
            switches = {line.split(":")[0]: int(line.split(":")[1])
                        for line in open(f"{base}/status") if "ctxt_switches" in line}
        except OSError:
            continue  # (a thread that ended)
        vcpu = int(stat.rsplit(")", 1)[1].split()[36])
        out[f"{name}:{tid}"] = (vcpu, run, wait, switches["voluntary_ctxt_switches"],
                                switches["nonvoluntary_ctxt_switches"])
    return out


def per_call(before, after, calls):
    """Threads that ran at least 0.1 ms in the block, per call."""
    rows = {}
    for key, (vcpu, run, wait, vol, invol) in after.items():
        if key not in before or run - before[key][1] < 100_000:
            continue
        b = before[key]
        rows[key.split(":")[0]] = {
            "vcpu": vcpu, "run_ns": (run - b[1]) // calls, "wait_ns": (wait - b[2]) // calls,
            "voluntary": round((vol - b[3]) / calls, 2), "involuntary": round((invol - b[4]) / calls, 2)}
    return rows


def world(rank, world_size, blocks, calls, pin, opts):
    if pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    _init(rank, world_size, "TORCH_RPC_EXT", opts, ["caller", "callee"])
    rows = []
    if rank == 0:
        callee = rpc.rpc_sync("callee", os.getpid)
        one = torch.ones(1)

        def call():
            return rpc.rpc_sync("callee", torch.add, args=(one, one))

        timed(call, 0, 300)
        for block in range(blocks):
            before = (threads_of(os.getpid()), threads_of(callee))
            samples = timed(call, calls, 0)
            after = (threads_of(os.getpid()), threads_of(callee))
            rows.append({"block": block, "median_us": round(statistics.median(samples) * 1e6, 1),
                         "caller": per_call(before[0], after[0], calls),
                         "callee": per_call(before[1], after[1], calls)})
            time.sleep(0.2)
    rpc.shutdown()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=14)
    p.add_argument("--calls", type=int, default=300, help="calls in a block")
    p.add_argument("--pin", action="store_true", help="each process on a vCPU of its own")
    p.add_argument("--poll-on-caller-cpu", choices=["on", "off"],
                   help="the option (default: its default)")
    p.add_argument("--out", type=Path)
    cfg = p.parse_args(argv)
    opts = ({} if cfg.poll_on_caller_cpu is None
            else {"poll_on_caller_cpu": cfg.poll_on_caller_cpu == "on"})
    rows, _ = run_world(world, 2, cfg.blocks, cfg.calls, cfg.pin, opts)
    out = cfg.out.open("w") if cfg.out else None
    for row in rows:
        row["pinned"] = cfg.pin
        row["poll_on_caller_cpu"] = cfg.poll_on_caller_cpu
        emit(row)
        if out:
            emit(row, out)
    summary = {"case": "small_builtin_blocks", "pinned": cfg.pin,
               "median_of_blocks_us": statistics.median(r["median_us"] for r in rows),
               "blocks_us": [r["median_us"] for r in rows]}
    emit(summary)
    if out:
        emit(summary, out)


if __name__ == "__main__":
    main()
