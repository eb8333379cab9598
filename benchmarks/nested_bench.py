# SPDX-License-Identifier: BSD-3-Clause
"""Calls that make calls: TORCH_RPC_EXT and TensorPipe side by side.

Three workers on one host. worker0 times `rpc_sync` to worker1 of a Python
UDF that, while worker1 serves it:

  plain             makes no call (the floor of the cases below)
  nested_to_third   waits for a call of its own to worker2 (rpc_sync)
  nested_to_caller  waits for a call of its own back to worker0
  fire_and_forget   sends a call to worker2 and returns without waiting
  rref_arg          takes an RRef owned by worker2 (torch's RRef protocol
                    sends messages of its own while the request is served)

A served request runs on the transport loop that read it (docs/
architecture.md, "Threads"); one that waits for a response that loop must
read needs the loop handed to another thread. Rows: the median round trip
in us per (backend, case), with `--rounds N` the median of N alternating
rounds and each round's; then `time_ext_over_tp` per case, and ours'
`loop_handoffs` / `loop_takeovers` per call on worker1.

    python benchmarks/nested_bench.py --rounds 3 --out nested.jsonl
    python benchmarks/nested_bench.py --smoke
"""

import argparse
import os
import statistics
import sys
import time

import torch
from torch.distributed import rpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import emit, run_world  # noqa: E402

import torch_rpc_ext  # noqa: E402,F401  (registers the backend)

CASES = ("plain", "nested_to_third", "nested_to_caller", "fire_and_forget", "rref_arg")


def plain(x):
    return x


def nested_to_third(x):
    return rpc.rpc_sync("worker2", torch.add, args=(x, x))


def nested_to_caller(x):
    return rpc.rpc_sync("worker0", torch.add, args=(x, x))


def fire_and_forget(x):
    rpc.rpc_async("worker2", torch.add, args=(x, x))
    return x


def rref_arg(rref):
    return rref.owner().name


def loop_counts():
    m = rpc.api._get_current_rpc_agent().get_metrics()
    return {k: sum(int(v) for name, v in m.items()
                   if name.endswith(f".loop_{k}")) for k in ("handoffs", "takeovers")}


def worker(rank, world_size, backend, calls, warmup):
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 backend=rpc.BackendType[backend],
                 rpc_backend_options=None if backend == "TORCH_RPC_EXT" else
                 rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=60))
    out = {}
    if rank == 0:
        x = torch.ones(2)
        rref = rpc.remote("worker2", torch.add, args=(x, x))
        for case in CASES:
            fn, arg = globals()[case], (rref if case == "rref_arg" else x)
            for _ in range(warmup):
                rpc.rpc_sync("worker1", fn, args=(arg,))
            ours = backend == "TORCH_RPC_EXT"
            before = rpc.rpc_sync("worker1", loop_counts) if ours else None
            samples = []
            for _ in range(calls):
                t0 = time.perf_counter()
                rpc.rpc_sync("worker1", fn, args=(arg,))
                samples.append(time.perf_counter() - t0)
            row = {"median_us": round(statistics.median(samples) * 1e6, 1)}
            if ours:
                after = rpc.rpc_sync("worker1", loop_counts)
                row.update({f"{k}_per_call": round((after[k] - before[k]) / calls, 3)
                            for k in after})
            out[case] = row
    rpc.shutdown()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="few calls, one round")
    p.add_argument("--out")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.calls, args.warmup = 1, 20, 5
    out = open(args.out, "w") if args.out else None

    def record(row):
        emit(row)
        if out:
            emit(row, out)

    per_round = {b: {c: [] for c in CASES} for b in ("ext", "tensorpipe")}
    extra = {c: {} for c in CASES}
    for r in range(args.rounds):
        order = [("ext", "TORCH_RPC_EXT"), ("tensorpipe", "TENSORPIPE")]
        for name, key in order if r % 2 == 0 else order[::-1]:
            res, _ = run_world(worker, 3, key, args.calls, args.warmup, timeout=900)
            for case, row in res.items():
                per_round[name][case].append(row["median_us"])
                if name == "ext":
                    for k in ("handoffs_per_call", "takeovers_per_call"):
                        extra[case].setdefault(k, []).append(row[k])
    for case in CASES:
        for name in ("ext", "tensorpipe"):
            rounds = per_round[name][case]
            row = {"backend": name, "case": case, "median_us": statistics.median(rounds),
                   "per_round": rounds}
            if name == "ext":
                row.update({k: statistics.median(v) for k, v in extra[case].items()})
            record(row)
        ratios = [e / t for e, t in zip(per_round["ext"][case], per_round["tensorpipe"][case])]
        record({"case": case, "ratio": "time_ext_over_tp",
                "value": round(statistics.median(ratios), 3),
                "per_round": [round(v, 3) for v in ratios]})


if __name__ == "__main__":
    main()
