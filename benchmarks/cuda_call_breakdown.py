# SPDX-License-Identifier: BSD-3-Clause
"""Where a CUDA call's time goes, hand-off by hand-off (issue 46).

The GPU run of 2026-11-27 (docs/gpu-runs/2026-11-27-h200/) put a round trip
of one 4 KB CUDA tensor at 447 us and a CPU call between the same two
workers at 197 us: the difference is not the copy (4 us). This splits it the
way small_call_breakdown.py splits a CPU call: both workers run with
TORCH_RPC_EXT_CALL_TRACE=1, the caller times each `rpc_sync` (device
synchronised before and after, as cuda_bench.py does) and the stamps are
joined by call id into the same eleven segments (and callee_run's two
parts: the function's run, and what follows until the response starts), for

  cpu_4KB        a CPU tensor between the two workers (device maps on)
  cuda_4KB       one CUDA tensor there and back (cuda_ipc)
  self_4KB       one CUDA tensor to the caller's own worker (cuda_self)
  many_1000x1KB  a list of 1000 CUDA tensors of 1 KB

On a GPU (torch's CUDA) or, with --fake, on the fake driver of
tests/cuda_fake (TORCH_RPC_EXT_LIBCUDA set; its figures say where host time
goes on this machine, not what a GPU costs). JSON lines: a row per case and
segment (median us) and a row per case's total.

    python benchmarks/cuda_call_breakdown.py [--fake] [--zero-copy] [--calls 300]

cuda_4KB's row also has the caller's cProfile (its own Python time per call
by function, in a second pass of the same calls).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["TORCH_RPC_EXT_CALL_TRACE"] = "1"  # before the extension loads

import cuda_bench  # noqa: E402
import small_call_breakdown as scb  # noqa: E402
import torch  # noqa: E402
from _harness import emit, run_world  # noqa: E402
from torch.distributed import rpc  # noqa: E402

CASES = ("cpu_4KB", "cuda_4KB", "self_4KB", "many_1000x1KB")


def profiled(call, n):
    """The caller's Python-side cost per call, by function (cProfile): the
    15 heaviest, in us per call of their own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:15]
    return [{"function": f"{path.rsplit('/', 1)[-1]}:{line}:{name}",
             "own_us_per_call": round(st[2] / n * 1e6, 2)}
            for (path, line, name), st in rows]


def world(rank, world_size, fake, calls, warmup, cases, zero_copy):
    dev = cuda_bench._init(rank, "TORCH_RPC_EXT", None, fake, zero_copy)
    results = {}
    if rank == 0:
        for case in cases:
            if case == "cpu_4KB":
                arg = torch.rand(1024)
            elif case == "many_1000x1KB":
                arg = [dev.tensor(1024) for _ in range(1000)]
            else:
                arg = dev.tensor(4096)
            to = "caller" if case.startswith("self") else "callee"
            n = calls // 5 if case.startswith("many") else calls
            for _ in range(warmup):
                dev.sync()
                rpc.rpc_sync(to, cuda_bench.identity, args=(arg,))
                dev.sync()
            scb.take()
            rpc.rpc_sync("callee", scb.take)
            windows = []
            for _ in range(n):
                dev.sync()
                t0 = time.perf_counter_ns()
                out = rpc.rpc_sync(to, cuda_bench.identity, args=(arg,))
                dev.sync()
                windows.append((t0, time.perf_counter_ns()))
                del out
            mine = scb.take()
            theirs = mine if to == "caller" else rpc.rpc_sync("callee", scb.take)
            results[case] = {"windows": windows, "caller": mine, "callee": theirs}
            if case == "cuda_4KB":

                def call(to=to, arg=arg):
                    dev.sync()
                    rpc.rpc_sync(to, cuda_bench.identity, args=(arg,))
                    dev.sync()

                results[case]["profile"] = profiled(call, n)
    rpc.shutdown()
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fake", action="store_true",
                   help="on the fake driver (TORCH_RPC_EXT_LIBCUDA), a CPU torch")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--zero-copy", action="store_true", help="cuda_zero_copy=True")
    cfg = p.parse_args(argv)
    if cfg.fake and not os.environ.get("TORCH_RPC_EXT_LIBCUDA"):
        p.error("--fake needs TORCH_RPC_EXT_LIBCUDA naming the fake driver")
    results, _ = run_world(world, 2, cfg.fake, cfg.calls, cfg.warmup, cfg.cases,
                          cfg.zero_copy, timeout=600, start=None if cfg.fake else "spawn")
    for case in cfg.cases:
        durations, totals = scb.breakdown(results[case])
        if not totals:
            raise SystemExit(f"no {case} call came back whole: is the build's call trace on?")
        for name, _, _ in scb.SEGMENTS:
            emit({"case": case, "segment": name, **scb.stats(durations[name])})
        for name, _, _, of in scb.PARTS:
            if durations[name]:
                emit({"case": case, "part": name, "of": of, **scb.stats(durations[name])})
        emit({"case": case, "segment": "total", "fake": cfg.fake, "zero_copy": cfg.zero_copy,
              **scb.stats(totals)})
        if "profile" in results[case]:
            emit({"case": case, "caller_profile": results[case]["profile"]})


if __name__ == "__main__":
    main()
