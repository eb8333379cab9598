# SPDX-License-Identifier: BSD-3-Clause
"""Many processes on one host (issue #11): TORCH_RPC_EXT over shm, over tcp,
and TensorPipe, side by side in one run.

For each process count N and backend, N workers are forked from this process
(torch imported once: 64 separate imports would not fit in memory or time on
a small machine) and each one:
  1. init_rpc (env:// rendezvous)                               -> init_s
  2. all-to-all: rpc_async(torch.add) on a 1-element tensor and on a 1 MB
     tensor to every other worker, wait all, check every result; the first
     pass opens the connections (a2a_first_s), later passes reuse them
     (a2a_warm_s, their median); a barrier starts each pass together
  3. rpc.shutdown() (graceful)                                  -> shutdown_s
Times are the max over workers (the world is as slow as its slowest member).
Memory: peak RSS per process (includes the pages shared with this parent) and
PSS / USS after the all-to-all. Failed calls are counted and their texts
kept; every world has a deadline, after which its remaining processes are
killed and reported by stage, so a backend that hangs is a row, not a hang.
Workers' stdout/stderr go to --logs (per world). A world whose memory,
estimated from this run's smaller worlds, clearly exceeds what the machine
has is skipped and says so (--mem-fit); workers volunteer for the OOM killer,
and a worker it takes is reported as oom_killed.

One JSON line per backend x size (x round), then ratio lines (ours over
TensorPipe, shm over tcp) where both sides completed without failures.

  python benchmarks/scale.py --sizes 16 32 64 --chart scale.png \\
      --out benchmarks/results/scale.jsonl
  python benchmarks/scale.py --sizes 4 --backends ext-shm ext-tcp   # smoke
"""

import argparse
import collections
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # a source checkout works without installing
from _harness import emit, memory_mb, rss_mb, run_forked_world  # noqa: E402

import torch_rpc_ext  # noqa: E402  (registers TORCH_RPC_EXT before the forks)

BACKENDS = ["ext-shm", "ext-tcp", "tensorpipe"]
# Diagnostic variants (not run by default): shm with only some channels.
CHANNEL_VARIANTS = {"ext-shm-ring": ("shm_ring",), "ext-shm-stream": ()}
# TensorPipe over TCP only (its "uv" transport, "basic" channel): its default
# (shm transport, cma channel) does not fit 64 processes in 24 GB.
TP_UV = "tensorpipe-uv"
STAGES = ["forked", "init_rpc", "barrier", "all_to_all", "shutdown", "done"]
MB_FLOATS = (1 << 20) // 4
METRICS = ["init_s", "a2a_first_s", "a2a_warm_s", "shutdown_s"]


def _options(backend, cfg):
    common = {"num_worker_threads": cfg.threads, "rpc_timeout": cfg.rpc_timeout}
    if backend == "tensorpipe":
        return rpc.BackendType.TENSORPIPE, rpc.TensorPipeRpcBackendOptions(**common)
    if backend == TP_UV:
        return rpc.BackendType.TENSORPIPE, rpc.TensorPipeRpcBackendOptions(
            _transports=["uv"], _channels=["basic"], **common
        )
    transport = backend.split("-")[1]
    if backend in CHANNEL_VARIANTS:
        common["channels"] = CHANNEL_VARIANTS[backend]
    return rpc.BackendType.TORCH_RPC_EXT, torch_rpc_ext.RpcExtBackendOptions(
        transports=(transport,), address="127.0.0.1", **common
    )


def _all_to_all(rank, world_size):
    futs = []
    for peer in range(world_size):
        if peer != rank:
            small = rpc.rpc_async(f"w{peer}", torch.add, args=(torch.tensor([rank]), 1))
            big = rpc.rpc_async(
                f"w{peer}", torch.add, args=(torch.full((MB_FLOATS,), float(rank)), 1.0)
            )
            futs += [(peer, small), (peer, big)]
    errors = []
    for peer, fut in futs:
        try:
            if not bool((fut.wait() == rank + 1).all()):
                errors.append(f"to w{peer}: wrong result")
        except Exception as e:  # noqa: BLE001 - counted and reported
            errors.append(f"to w{peer}: {e}")
    return len(futs), errors


def worker(rank, world_size, report, at, backend, cfg, barrier):
    torch.set_num_threads(1)
    # TensorPipe's init_rpc says this once per worker: N lines of noise.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    backend_type, options = _options(backend, cfg)
    at(STAGES.index("init_rpc"))
    t0 = time.perf_counter()
    rpc.init_rpc(
        f"w{rank}",
        rank=rank,
        world_size=world_size,
        backend=backend_type,
        rpc_backend_options=options,
    )
    report(init_s=time.perf_counter() - t0)
    calls, errors, passes = 0, [], []
    for _ in range(1 + cfg.warm_passes):
        at(STAGES.index("barrier"))
        barrier.wait(timeout=cfg.deadline)
        at(STAGES.index("all_to_all"))
        t0 = time.perf_counter()
        n, errs = _all_to_all(rank, world_size)
        passes.append(time.perf_counter() - t0)
        calls, errors = calls + n, errors + errs
        report(
            calls=calls,
            errors=errors[:50],
            failed=len(errors),
            passes=passes,
            **memory_mb(),
        )
    at(STAGES.index("shutdown"))
    t0 = time.perf_counter()
    try:
        rpc.shutdown()
    except Exception as e:  # noqa: BLE001 - reported
        report(shutdown_error=str(e))
    report(shutdown_s=time.perf_counter() - t0, peak_rss_mb=memory_mb()["peak_rss_mb"])
    at(STAGES.index("done"))


def _exit_name(code):
    if code is None:
        return "running"
    if code >= 0:
        return str(code)
    return signal.Signals(-code).name + (" (std::terminate)" if code == -6 else "")


def _kind(text):
    """Worker numbers, socket names and figures blanked: one line per kind."""
    text = re.sub(r"@torch_rpc_ext-[\w-]+", "@<socket>", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)


def _oom_killed(pids):
    """Which of these pids the kernel's OOM killer took (dmesg), if readable."""
    try:
        log = subprocess.run(
            ["dmesg"], check=False, capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted(r for r, pid in pids.items() if f"Killed process {pid} " in log)


def run_one(backend, size, cfg, log_dir):
    import multiprocessing

    os.makedirs(log_dir, exist_ok=True)
    barrier = multiprocessing.get_context("fork").Barrier(size)
    world = run_forked_world(
        worker, size, backend, cfg, barrier, deadline=cfg.deadline, log_dir=log_dir
    )
    res = world["results"]
    row = {
        "case": "scale",
        "backend": backend,
        "procs": size,
        "world_s": round(world["world_s"], 2),
    }

    def agg(values, fn=max, nd=3):
        return round(fn(values), nd) if values else None

    row["init_s"] = agg([r["init_s"] for r in res.values() if "init_s" in r])
    row["init_s_median"] = agg(
        [r["init_s"] for r in res.values() if "init_s" in r], statistics.median
    )
    first = [r["passes"][0] for r in res.values() if r.get("passes")]
    warm = [
        statistics.median(r["passes"][1:])
        for r in res.values()
        if len(r.get("passes", [])) > 1
    ]
    row["a2a_first_s"] = agg(first) if len(first) == size else None
    row["a2a_warm_s"] = agg(warm) if len(warm) == size else None
    shut = [r["shutdown_s"] for r in res.values() if "shutdown_s" in r]
    row["shutdown_s"] = agg(shut) if len(shut) == size else None
    rss = [r["peak_rss_mb"] for r in res.values() if "peak_rss_mb" in r]
    row["peak_rss_mb_max"] = agg(rss, max, 1)
    row["peak_rss_mb_mean"] = agg(rss, statistics.mean, 1)
    row["pss_mb_mean"] = agg(
        [r["pss_mb"] for r in res.values() if "pss_mb" in r], statistics.mean, 1
    )
    row["uss_mb_mean"] = agg(
        [r["uss_mb"] for r in res.values() if "uss_mb" in r], statistics.mean, 1
    )
    expected = size * (size - 1) * 2 * (1 + cfg.warm_passes)
    row["calls"] = expected
    row["completed_calls"] = sum(r.get("calls", 0) for r in res.values())
    row["failed_calls"] = sum(r.get("failed", 0) for r in res.values())
    texts = [t for r in res.values() for t in r.get("errors", [])]
    texts += [
        f"rpc.shutdown(): {r['shutdown_error']}"
        for r in res.values()
        if "shutdown_error" in r
    ]
    texts += [
        r["raised"].strip().splitlines()[-1] for r in res.values() if "raised" in r
    ]
    # Counted over the first 50 texts of each worker (failed_calls is exact).
    row["failure_kinds"] = dict(
        collections.Counter(_kind(t) for t in texts).most_common(8)
    )
    row["first_failures"] = texts[:3]
    row["exit_codes"] = dict(
        collections.Counter(
            _exit_name(c)
            for r, c in world["exit_codes"].items()
            if r not in world["hung"]
        )
    )
    hung: dict[str, list[int]] = {}
    for r, s in sorted(world["hung"].items()):
        hung.setdefault(STAGES[s], []).append(r)
    row["hung_killed_at_deadline"] = hung
    killed = {
        r: world["pids"][r]
        for r, c in world["exit_codes"].items()
        if c == -signal.SIGKILL and r not in world["hung"]
    }
    if killed:
        row["oom_killed"] = _oom_killed(killed)
    logs = [Path(log_dir, f).read_text(errors="replace") for f in os.listdir(log_dir)]
    row["terminate_msgs"] = sum(t.count("terminate called") for t in logs)
    row["log_lines"] = sum(t.count("\n") for t in logs)
    row["logs"] = log_dir
    row["ok"] = (
        not texts
        and not hung
        and row["exit_codes"] == {"0": size}
        and row["completed_calls"] == expected
    )
    return row


def _mem_available_mb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def too_big(backend, size, rows, cfg):
    """A reason to skip this world, or None. Per-process memory (PSS) grows
    with the number of peers (a connection each): the estimate scales the
    largest smaller world of this backend measured in this run by peers, times
    processes. That overestimates (part of each process's memory is fixed),
    hence the slack: skip when it exceeds --mem-fit x MemAvailable. A world
    that still overshoots loses its own workers to the OOM killer (they
    volunteer), reported as oom_killed."""
    if cfg.mem_fit <= 0:
        return None
    smaller = [
        r
        for r in rows
        if r["backend"] == backend and r["procs"] < size and r.get("pss_mb_mean")
    ]
    if not smaller:
        return None
    ref = max(smaller, key=lambda r: r["procs"])
    need = ref["pss_mb_mean"] * (size - 1) / (ref["procs"] - 1) * size
    free = _mem_available_mb()
    if need <= free * cfg.mem_fit:
        return None
    return (
        f"memory: ~{need / 1024:.1f} GB estimated "
        f"(PSS {ref['pss_mb_mean']} MB/process "
        f"at {ref['procs']}, x {size - 1}/{ref['procs'] - 1} peers, "
        f"x {size} processes) "
        f"> {cfg.mem_fit} x {free / 1024:.1f} GB available"
    )


def ratios(rows, sizes, backends):
    """ours / TensorPipe and shm / tcp, per size: median over rounds of the
    per-round ratio, only where both rows completed without failures."""
    by = collections.defaultdict(list)
    for r in rows:
        by[(r["backend"], r["procs"])].append(r)
    pairs = [
        ("ext-shm", "tensorpipe"),
        ("ext-tcp", "tensorpipe"),
        ("ext-shm", TP_UV),
        ("ext-tcp", TP_UV),
        ("ext-shm", "ext-tcp"),
    ]
    out = []
    for size in sizes:
        for num, den in pairs:
            if num not in backends or den not in backends:
                continue
            a, b = by[(num, size)], by[(den, size)]
            row = {"case": "scale", "procs": size, "ratio": f"{num}/{den}"}
            bad = [
                f"{x['backend']} round {i} "
                + ("skipped" if "skipped" in x else "failed")
                for i, (ra, rb) in enumerate(zip(a, b))
                for x in (ra, rb)
                if not x["ok"]
            ]
            if bad:
                row["valid"] = False
                row["why"] = "; ".join(sorted(set(bad)))
            for m in METRICS + ["peak_rss_mb_mean", "pss_mb_mean"]:
                per_round = [
                    ra[m] / rb[m]
                    for ra, rb in zip(a, b)
                    if ra.get(m) and rb.get(m) and ra["ok"] and rb["ok"]
                ]
                row[m] = round(statistics.median(per_round), 3) if per_round else None
            out.append(row)
    return out


def chart(rows, path):
    """Init and all-to-all times vs process count, one line per backend;
    a red cross marks a world with failures (its time is still drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("init_s", "init_rpc (max over workers)"),
        ("a2a_first_s", "all-to-all, first pass (connects)"),
        ("a2a_warm_s", "all-to-all, warm"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    by = collections.defaultdict(list)
    for r in rows:
        by[(r["backend"], r["procs"])].append(r)
    for ax, (metric, title) in zip(axes, panels):
        for backend in sorted({b for b, _ in by}):
            xs, ys, fails = [], [], []
            for (b, size), rs in sorted(by.items(), key=lambda kv: kv[0][1]):
                vals = [r[metric] for r in rs if r.get(metric) is not None]
                if b != backend or not vals:
                    continue
                xs.append(size)
                ys.append(statistics.median(vals))
                if not all(r["ok"] for r in rs):
                    fails.append((size, ys[-1]))
            ax.plot(xs, ys, marker="o", label=backend)
            if fails:
                ax.scatter(*zip(*fails), marker="x", s=120, color="red", zorder=3)
        sizes = sorted({size for _, size in by})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(x) for x in sizes])
        ax.minorticks_off()
        ax.set_title(title)
        ax.set_xlabel("processes")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(
        "one host, all-to-all rpc_async (1-element + 1 MB torch.add); "
        "red x: world had failures or was killed"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS + list(CHANNEL_VARIANTS) + [TP_UV],
        default=BACKENDS,
        help="ext-shm-ring / ext-shm-stream: shm with only the ring channel / "
        "no channel (the stream carries every byte), for diagnosis; "
        "tensorpipe-uv: TensorPipe over TCP only (fits where its default "
        "does not)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every backend x size this many times, alternating the "
        "backend order; ratios are medians of per-round ratios",
    )
    p.add_argument(
        "--warm-passes",
        type=int,
        default=2,
        help="all-to-all passes after the first (connected) one",
    )
    p.add_argument("--threads", type=int, default=4, help="num_worker_threads")
    p.add_argument("--rpc-timeout", type=float, default=60)
    p.add_argument(
        "--deadline",
        type=float,
        default=300,
        help="seconds per world before its processes are killed",
    )
    p.add_argument(
        "--mem-fit",
        type=float,
        default=1.25,
        help="skip a world whose estimated memory exceeds this x MemAvailable "
        "(0: never skip)",
    )
    p.add_argument(
        "--logs",
        type=Path,
        help="folder for the workers' stdout/stderr (default: a new temp folder)",
    )
    p.add_argument("--chart", type=Path, help="PNG of times vs processes (matplotlib)")
    p.add_argument("--out", type=Path, help="also write the JSON lines here")
    cfg = p.parse_args(argv)
    out = cfg.out.open("w") if cfg.out else None

    def record(row):
        emit(row)
        if out:
            emit(row, out)

    record(
        {
            "case": "scale_setup",
            "parent_rss_mb": round(rss_mb(), 1),
            "mem_available_mb": round(_mem_available_mb()),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "sizes": cfg.sizes,
            "backends": cfg.backends,
            "rounds": cfg.rounds,
            "warm_passes": cfg.warm_passes,
            "num_worker_threads": cfg.threads,
            "deadline_s": cfg.deadline,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    )
    logs = cfg.logs or Path(tempfile.mkdtemp(prefix="scale-logs-"))
    rows = []
    for rnd in range(cfg.rounds):
        for size in cfg.sizes:
            order = cfg.backends if rnd % 2 == 0 else cfg.backends[::-1]
            for backend in order:
                why = too_big(backend, size, rows, cfg)
                if why:
                    row = {
                        "case": "scale",
                        "backend": backend,
                        "procs": size,
                        "skipped": why,
                        "ok": False,
                    }
                else:
                    row = run_one(
                        backend, size, cfg, str(logs / f"{backend}-{size}-r{rnd}")
                    )
                if cfg.rounds > 1:
                    row["round"] = rnd
                rows.append(row)
                record(row)
    for row in ratios(rows, cfg.sizes, cfg.backends):
        record(row)
    if cfg.chart:
        chart(rows, cfg.chart)


if __name__ == "__main__":
    main()
