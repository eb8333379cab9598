# SPDX-License-Identifier: BSD-3-Clause
"""Process worlds, timers, percentiles and JSON lines for the benchmarks."""

import json
import os
import pickle
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb() -> float:
    """This process's resident set now, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarize(samples_s: list[float]) -> dict[str, float]:
    """Median and p90 of per-call seconds, in microseconds."""
    xs = sorted(samples_s)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return {
        "median_us": round(statistics.median(xs) * 1e6, 1),
        "p90_us": round(p90 * 1e6, 1),
        "n": len(xs),
    }


def timed(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _entry(target, rank, world_size, port, queue, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        result = target(rank, world_size, *args)
        queue.put((rank, pickle.dumps(result), peak_rss_mb()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, pickle.dumps(RuntimeError(traceback.format_exc())), 0.0))
        raise e


def run_world(
    target: Callable, world_size: int, *args: Any, timeout: float = 1800, dies: int = 0
):
    """Spawn ``world_size`` processes of ``target(rank, world_size, *args)``.

    ``dies`` of them (never rank 0) are expected to be killed and report
    nothing. Returns (rank 0's result, {rank: peak RSS MB}).
    """
    results, rss = run_world_all(target, world_size, *args, timeout=timeout, dies=dies)
    return results[0], rss


def run_world_all(
    target: Callable, world_size: int, *args: Any, timeout: float = 1800, dies: int = 0
):
    """Like run_world, but returns ({rank: result}, {rank: peak RSS MB})."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(target, r, world_size, port, queue, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, rss = {}, {}
    try:
        for _ in range(len(procs) - dies):
            rank, blob, mb = queue.get(timeout=timeout)
            results[rank] = pickle.loads(blob)
            rss[rank] = round(mb, 1)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r, v in results.items():
        if isinstance(v, Exception):
            raise RuntimeError(f"rank {r} failed:\n{v}")
    return results, rss


def emit(row: dict, stream=sys.stdout) -> None:
    stream.write(json.dumps(row) + "\n")
    stream.flush()
