# SPDX-License-Identifier: BSD-3-Clause
"""Process worlds, timers, percentiles and JSON lines for the benchmarks."""

import json
import os
import pickle
import resource
import statistics
import sys
import time
from collections.abc import Callable
from queue import Empty
from typing import Any

import torch.multiprocessing as mp

from torch_rpc_ext import _preloaded
from torch_rpc_ext._ports import free_port  # noqa: F401  (below the ephemeral range)


def rss_mb() -> float:
    """This process's resident set now, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def thread_cpu_ns() -> dict:
    """This process's CPU time so far, in ns: each thread's by id, with its
    name (the kernel's schedstat: time on a CPU; the main thread named
    "main"), and the whole process's (threads that exited included). Our
    threads are named by role (docs/architecture.md, "Threads"); TensorPipe's
    and torch's mostly inherit "python"."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
        threads[int(tid)] = ("main" if int(tid) == os.getpid() else name, ns)
    return {"threads": threads, "process": time.process_time_ns()}


def cpu_us_per_call(before: dict, after: dict, calls: int) -> dict:
    """CPU per call, in us, by thread name, between two thread_cpu_ns(), the
    busiest first; what threads that ended meanwhile used (a loop thread
    handed on, a pool thread retired) as "(ended threads)"."""
    per: dict[str, float] = {}
    for tid, (name, ns) in after["threads"].items():
        start = before["threads"].get(tid, (name, 0))[1]
        per[name] = per.get(name, 0) + (ns - start) / 1e3 / calls
    ended = (after["process"] - before["process"]) / 1e3 / calls - sum(per.values())
    per["(ended threads)"] = ended
    return {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.05}


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
    target: Callable, world_size: int, *args: Any, timeout: float = 1800, dies: int = 0,
    start: str | None = None,
):
    """Start ``world_size`` processes of ``target(rank, world_size, *args)``
    (as start_world() does).

    ``dies`` of them (never rank 0) are expected to be killed and report
    nothing. Returns (rank 0's result, {rank: peak RSS MB}).
    """
    results, rss = run_world_all(target, world_size, *args, timeout=timeout, dies=dies,
                                 start=start)
    return results[0], rss


def run_world_all(
    target: Callable, world_size: int, *args: Any, timeout: float = 1800, dies: int = 0,
    start: str | None = None,
):
    """Like run_world, but returns ({rank: result}, {rank: peak RSS MB})."""
    return finish_world(start_world(target, world_size, *args, start=start), timeout=timeout,
                        dies=dies)


def start_world(target: Callable, world_size: int, *args: Any, port: int | None = None,
                start: str | None = None):
    """Start ``world_size`` processes of ``target(rank, world_size, *args)``
    on ``port`` (a free one by default) and return at once: several worlds
    can run side by side, each on a port of its own. finish_world() collects
    them.

    Each is forked from a server that imported torch and torch_rpc_ext
    once (torch_rpc_ext/_preloaded.py says what it gets from this process,
    and what is the server's instead: what is read while importing torch,
    and the script's top level); a spawned worker spends ~3 s of CPU
    importing torch, and CI starts about 50. Its peak RSS counts the pages
    it shares with the server, so compare memory figures only with others
    taken the same way. ``start="spawn"`` (or
    TORCH_RPC_EXT_BENCH_START=spawn) spawns them: what a benchmark on a
    real CUDA driver does (cuda_bench.py without --fake), keeping every
    process's CUDA as a user's program would have it."""
    start = start or os.environ.get("TORCH_RPC_EXT_BENCH_START") or "preloaded"
    if start not in ("preloaded", "spawn"):
        raise ValueError(f"start (or TORCH_RPC_EXT_BENCH_START) is preloaded or spawn, "
                         f"not {start!r}")
    ctx = _preloaded.start_context(start)
    queue = ctx.Queue()
    port = port or free_port()
    procs = [
        ctx.Process(target=_entry, args=(target, r, world_size, port, queue, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs, queue


def finish_world(world, timeout: float = 1800, dies: int = 0):
    """Wait for a start_world() world: ({rank: result}, {rank: peak RSS MB});
    raises naming a rank that failed. ``dies`` ranks report nothing.

    A rank that fails ends the world at once, the others killed: the
    survivors of a world whose peer is gone can wait forever (upstream's
    shutdown waits for its all-gather without a limit), and what counts is
    the failed rank's traceback, not the hang it leaves behind. So does a
    rank that exits without reporting, unless ``dies`` allows for it."""
    procs, queue = world
    results, rss = {}, {}
    deadline = time.monotonic() + timeout
    silent_since: dict[int, float] = {}
    complete = False
    try:
        while len(results) < len(procs) - dies:
            try:
                rank, blob, mb = queue.get(timeout=1.0)
            except Empty:  # look at who is still there
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(len(procs))) - set(results))} "
                        f"reported nothing in {timeout:.0f} s") from None
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None:
                        silent_since.setdefault(r, now)
                # Its result may still be in the queue's pipe: a grace. More
                # silent ranks than `dies`, or rank 0 among them, is a failure.
                silent = sorted(r for r, t in silent_since.items()
                                if r not in results and now - t > 10)
                if len(silent) > dies or 0 in silent:
                    raise RuntimeError(
                        f"ranks {silent} exited without reporting (codes "
                        f"{[procs[r].exitcode for r in silent]}; {dies} may)"
                    ) from None
                continue
            results[rank] = pickle.loads(blob)
            rss[rank] = round(mb, 1)
            if isinstance(results[rank], Exception):
                print(f"rank {rank} failed:\n{results[rank]}", file=sys.stderr, flush=True)
                break
        else:
            complete = True
    finally:
        for p in procs:
            p.join(timeout=30 if complete else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    for r, v in results.items():
        if isinstance(v, Exception):
            raise RuntimeError(f"rank {r} failed:\n{v}")
    return results, rss


def emit(row: dict, stream=sys.stdout) -> None:
    stream.write(json.dumps(row) + "\n")
    stream.flush()


def memory_mb() -> dict[str, float]:
    """Peak RSS (VmHWM) and, from smaps_rollup, PSS and private (USS) now, in
    MB. A forked child's RSS counts the pages it shares with its parent; PSS
    splits them among the sharers, USS leaves them out."""
    out = {"peak_rss_mb": peak_rss_mb()}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                out["peak_rss_mb"] = int(line.split()[1]) / 1024
    private = 0
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "Pss":
                    out["pss_mb"] = int(rest.split()[0]) / 1024
                elif key in ("Private_Clean", "Private_Dirty"):
                    private += int(rest.split()[0])
        out["uss_mb"] = private / 1024
    except OSError:
        pass
    return out


def _forked_entry(target, rank, world_size, port, reports, stage, log_dir, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # First in line for the OOM killer: a world too big for a shared machine
    # loses its own workers (reported as SIGKILL), not a neighbour's.
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    if log_dir is not None:
        # N processes' C++ warnings would bury the JSON lines.
        log = os.open(os.path.join(log_dir, f"rank{rank}.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)

    def report(**fields):
        """Send fields to the parent now (a later hang loses nothing sent)."""
        reports.put((rank, pickle.dumps(fields)))

    def at(code: int):
        stage[rank] = code

    try:
        target(rank, world_size, report, at, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback

        report(raised=traceback.format_exc())
    reports.close()
    reports.join_thread()


def run_forked_world(target: Callable, world_size: int, *args: Any, deadline: float,
                     log_dir: str | None = None):
    """Fork ``world_size`` processes of ``target(rank, world_size, report, at,
    *args)`` from this process, which must have imported what they need but
    run no torch compute (forked ATen thread pools hang).

    ``report(**fields)`` merges fields into the rank's result at once;
    ``at(int)`` records the stage the rank is in. Every process still running
    ``deadline`` seconds after the first fork is killed (SIGKILL). With
    ``log_dir``, each rank's stdout and stderr go to ``log_dir/rank{r}.log``.
    Workers volunteer for the OOM killer (oom_score_adj 1000).

    Returns {"results": {rank: fields}, "exit_codes": {rank: code} (negative:
    killed by that signal), "hung": {rank: stage}, "pids": {rank: pid},
    "world_s": seconds}.
    """
    import queue as queue_module

    ctx = mp.get_context("fork")
    reports = ctx.Queue()
    stage = ctx.Array("i", world_size, lock=False)
    port = free_port()
    t0 = time.monotonic()
    procs = [
        ctx.Process(target=_forked_entry,
                    args=(target, r, world_size, port, reports, stage, log_dir, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {r: {} for r in range(world_size)}
    end = t0 + deadline

    def drain(wait: float) -> bool:
        try:
            rank, blob = reports.get(timeout=wait)
        except queue_module.Empty:
            return False
        results[rank].update(pickle.loads(blob))
        return True

    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            drain(min(0.5, max(0.01, end - time.monotonic())))
    finally:
        hung = {r: stage[r] for r, p in enumerate(procs) if p.is_alive()}
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
    while drain(0.05):
        pass
    return {
        "results": results,
        "exit_codes": {r: p.exitcode for r, p in enumerate(procs)},
        "hung": hung,
        "pids": {r: p.pid for r, p in enumerate(procs)},
        "world_s": time.monotonic() - t0,
    }
