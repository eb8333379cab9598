# SPDX-License-Identifier: BSD-3-Clause
"""TORCH_RPC_EXT vs TensorPipe, side by side in one run: the RPC paper's matrix.

Cases: small-call latency (builtin, Python UDF, TorchScript), pipelined
rpc_async throughput, 1000 tensors of 1 KiB in one call (many),
identity/heavy x Python/TorchScript x 4 MB/400 MB x 1/10 calls in flight,
a fan-out (one caller, 8 workers) and TCP-only mode.
Every case runs on each backend in the same invocation; the output is JSON
lines (one per case and backend, then one ratio line per case) and, with
--chart, a PNG. The pipelined rows carry `cpu_us_per_call`: each process's
CPU per call by thread (the caller's "main" issues the calls; ours are named
by role, rpcx-*), from the kernel's schedstat.

Examples:
  python benchmarks/rpc_bench.py                 # full matrix (several minutes)
  python benchmarks/rpc_bench.py --smoke         # tiny sizes, few iterations (CI)
  python benchmarks/rpc_bench.py --cases small pipelined --out results.jsonl
  python benchmarks/rpc_bench.py --cases small pipelined --interleave 30
      # both backends up at once, taking turns block by block
"""

import argparse
import gc
import os
import pickle
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # a source checkout works without installing
from _harness import (  # noqa: E402
    cpu_us_per_call,
    emit,
    finish_world,
    free_port,
    run_world,
    start_world,
    summarize,
    thread_cpu_ns,
    timed,
)
from _workloads import heavy, identity  # noqa: E402

BACKENDS = {
    # name -> (backend member name, options factory kwargs)
    "ext": ("TORCH_RPC_EXT", {}),
    "tensorpipe": ("TENSORPIPE", {}),
}
TCP_ONLY = {"ext": ("TORCH_RPC_EXT", {"transports": ("tcp",)}),
            "tensorpipe": ("TENSORPIPE", {"_transports": ["uv"]})}


@torch.jit.script
def script_identity(x: torch.Tensor) -> torch.Tensor:
    return x


@torch.jit.script
def script_heavy(x: torch.Tensor) -> torch.Tensor:
    for _ in range(100):
        x *= 2
        x /= 2
    return x


def noop_int(x):
    return x


@torch.jit.script
def script_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def _init(rank, world_size, backend_key, opts, names):

    import torch_rpc_ext  # noqa: F401  (registers TORCH_RPC_EXT)

    backend = rpc.BackendType[backend_key]
    kwargs = dict(opts, rpc_timeout=600)
    os.environ.update(kwargs.pop("_env", {}))  # (the worker's own process)
    if backend_key == "TENSORPIPE":
        options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, **kwargs)
    else:
        options = torch_rpc_ext.RpcExtBackendOptions(num_worker_threads=16, **kwargs)
    rpc.init_rpc(names[rank], rank=rank, world_size=world_size, backend=backend,
                 rpc_backend_options=options)
    # --gc: Python's cyclic collector in every worker, from here on.
    mode = os.environ.get("RPC_BENCH_GC", "on")
    if mode == "freeze":
        gc.freeze()
    elif mode == "off":
        gc.disable()


def pair_cases(rank, world_size, backend_key, opts, cases, cfg):
    """Rank 0 measures every pair case against rank 1."""
    _init(rank, world_size, backend_key, opts, ["caller", "callee"])
    rows = []
    if rank == 0:
        dst = "callee"
        one = torch.ones(1)
        if "small" in cases:
            for label, fn, args in [
                ("small_builtin", torch.add, (one, one)),
                ("small_udf", noop_int, (1,)),
                ("small_script", script_add, (one, one)),
            ]:
                # timed() runs the call now; the defaults bind this case's values.
                s = timed(lambda fn=fn, args=args: rpc.rpc_sync(dst, fn, args=args),
                          cfg.iters, cfg.warmup)
                rows.append({"case": label, **summarize(s)})
        if "pipelined" in cases:
            n = cfg.pipelined
            rpc.rpc_sync(dst, torch.add, args=(one, one))
            samples = []
            # Where the CPU goes, per call and thread, both processes (the
            # two calls that read the callee's count are in its window).
            cpu = (thread_cpu_ns(), rpc.rpc_sync(dst, thread_cpu_ns))
            for _ in range(max(3, cfg.repeats)):
                t0 = time.perf_counter()
                futs = [rpc.rpc_async(dst, torch.add, args=(one, one)) for _ in range(n)]
                torch.futures.wait_all(futs)
                samples.append(time.perf_counter() - t0)
            cpu = {"callee": cpu_us_per_call(cpu[1], rpc.rpc_sync(dst, thread_cpu_ns),
                                             n * len(samples)),
                   "caller": cpu_us_per_call(cpu[0], thread_cpu_ns(), n * len(samples))}
            best = sorted(samples)[len(samples) // 2]
            rows.append({"case": "pipelined_async", "calls_per_s": round(n / best),
                         "median_us": round(best / n * 1e6, 2), "n": n,
                         "cpu_us_per_call": cpu,
                         "cpu_us_per_call_total": round(
                             sum(sum(end.values()) for end in cpu.values()), 2)})
        if "many" in cases:
            # 1000 tensors of 1 KiB in one call and back: per-tensor costs
            # (pickling, the codec, allocations), which the bytes do not hide.
            xs = [torch.ones(256) for _ in range(cfg.many)]
            full = gc.get_stats()[2]["collections"]
            s = timed(lambda: rpc.rpc_sync(dst, identity, args=(xs,)), cfg.repeats * 2, 3)
            # Full collections on the caller meanwhile (warm-up included):
            # past some thousands of tensors a call they are most of the time.
            rows.append({"case": f"identity_{cfg.many}x1KB", **summarize(s),
                         "gc_full_collections": gc.get_stats()[2]["collections"] - full,
                         "gc_enabled": gc.isenabled(), "gc_frozen": gc.get_freeze_count()})
        if "tensor" in cases:
            for mb in cfg.sizes_mb:
                side = int((mb * (1 << 20) / 4) ** 0.5)
                x = torch.ones(side, side)
                for fname, fn in [("identity", identity), ("heavy", heavy),
                                  ("identity_script", script_identity),
                                  ("heavy_script", script_heavy)]:
                    if fname.startswith("heavy") and (
                            cfg.identity_only or (mb > 64 and not cfg.heavy_large)):
                        continue
                    for inflight in (1, 10):
                        if inflight == 10 and mb > 64:
                            continue  # 10 x 400 MB in flight exceeds the paper's RAM budget here
                        def call(fn=fn, x=x, inflight=inflight):
                            futs = [rpc.rpc_async(dst, fn, args=(x,)) for _ in range(inflight)]
                            torch.futures.wait_all(futs)
                        reps = cfg.repeats if mb <= 64 else cfg.repeats_large
                        s = timed(call, reps, 1)
                        rows.append({"case": f"{fname}_{mb:g}MB_x{inflight}", **summarize(s),
                                     "per_call_ms": round(
                                         summarize(s)["median_us"] / 1000 / inflight, 2)})
    rpc.shutdown()
    return rows


def block_server(rank, world_size, backend_key, opts, conn, cfg):
    """--interleave: rank 0 warms every small and pipelined case up, then
    runs one block of a case each time the parent asks, until it sends None.
    A small case's block answers its median call in us, the pipelined one
    its calls/s (one burst)."""
    _init(rank, world_size, backend_key, opts, ["caller", "callee"])
    if rank == 0:
        one = torch.ones(1)
        calls = {
            "small_builtin": lambda: rpc.rpc_sync("callee", torch.add, args=(one, one)),
            "small_udf": lambda: rpc.rpc_sync("callee", noop_int, args=(1,)),
            "small_script": lambda: rpc.rpc_sync("callee", script_add, args=(one, one)),
        }

        def burst(n):
            t0 = time.perf_counter()
            torch.futures.wait_all(
                [rpc.rpc_async("callee", torch.add, args=(one, one)) for _ in range(n)])
            return n / (time.perf_counter() - t0)

        conn.recv()  # "start"
        for call in calls.values():
            timed(call, 0, cfg.warmup)
        burst(cfg.pipelined)
        conn.send("ready")
        while (ask := conn.recv()) is not None:
            case, n = ask
            if case == "pipelined_async":
                conn.send(burst(n))
            else:
                conn.send(statistics.median(timed(calls[case], n, 0)) * 1e6)
    rpc.shutdown()
    return None


def interleaved(cfg, backends, record) -> None:
    """Both backends' pairs are up at once and take turns, one block of one
    case at a time (ours first in even blocks, TensorPipe first in odd
    ones): neighbouring blocks see the same state of the machine, so a
    ratio of two of them is not a ratio of a fast minute to a slow one.
    The pair whose turn it is not is stopped (SIGSTOP), so each runs alone
    as in a round: TensorPipe's idle processes each keep a core busy (its
    shm reactor polls), which would otherwise be taken from ours. Each
    ratio row is the median over blocks of the block's ratio, with its
    quartiles."""
    if cfg.rounds > 1 or not {"small", "pipelined"} & set(cfg.cases):
        raise SystemExit("--interleave runs the small and pipelined cases, in blocks, not rounds")
    worlds, conns = {}, {}

    def signal_pair(name, sig):
        for p in worlds[name][0]:
            if p.is_alive():
                os.kill(p.pid, sig)

    def ask(name, message):
        """Send a pair's rank 0 `message`; its answer, or an error naming the
        pair if it does not answer (a rank that died: its traceback)."""
        conns[name].send(message)
        deadline = time.monotonic() + 600
        while not conns[name].poll(1):
            procs, queue = worlds[name]
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                detail = queue.get(timeout=5)[1] if not queue.empty() else b""
                raise RuntimeError(f"{name}'s pair stopped answering ({message!r}): "
                                   f"{pickle.loads(detail) if detail else 'no report'}")
        return conns[name].recv()

    cases = [c for c in ("small_builtin", "small_udf", "small_script") if "small" in cfg.cases]
    if "pipelined" in cfg.cases:
        cases.append("pipelined_async")
    values = {(c, n): [] for c in cases for n in backends}
    rss = {}
    try:
        ports = set()
        for name, (key, opts) in backends.items():
            while (port := free_port()) in ports:
                pass
            ports.add(port)
            parent, child = mp.get_context("spawn").Pipe()
            conns[name] = parent
            worlds[name] = start_world(block_server, 2, key, opts, child, cfg, port=port)
            child.close()  # (the ranks hold theirs)
        for name in backends:
            if ask(name, "start") != "ready":
                raise RuntimeError(f"{name}'s pair did not start")
            signal_pair(name, signal.SIGSTOP)
        for block in range(cfg.interleave):
            for case in cases:
                order = list(backends) if block % 2 == 0 else list(reversed(backends))
                for name in order:
                    n = cfg.pipelined if case == "pipelined_async" else cfg.block_calls
                    signal_pair(name, signal.SIGCONT)
                    values[(case, name)].append(ask(name, (case, n)))
                    signal_pair(name, signal.SIGSTOP)
    finally:
        for name in worlds:
            signal_pair(name, signal.SIGCONT)
        for conn in conns.values():
            try:
                conn.send(None)
            except OSError:
                pass
        for name, world in worlds.items():
            try:
                rss[name] = finish_world(world, timeout=120)[1]
            except Exception as e:  # noqa: BLE001 - every world is reaped first
                print(f"rpc_bench: {name}'s pair: {e}", file=sys.stderr)

    def quartiles(xs):
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        return [round(q[0], 3), round(q[2], 3)]

    for case in cases:
        throughput = case == "pipelined_async"
        for name in backends:
            xs = values[(case, name)]
            key = "calls_per_s" if throughput else "median_us"
            record({"backend": name, "case": case, key: round(statistics.median(xs), 1),
                    "blocks": len(xs), "quartiles": quartiles(xs), "interleaved": True,
                    "peak_rss_mb": rss.get(name)})
        ext, tp = values[(case, "ext")], values[(case, "tensorpipe")]
        per_block = [e / t for e, t in zip(ext, tp)]
        record({"case": case, "interleaved": True, "blocks": len(per_block),
                "ratio": "throughput_ext_over_tp" if throughput else "time_ext_over_tp",
                "value": round(statistics.median(per_block), 3),
                "quartiles": quartiles(per_block),
                # In block order: a slow stretch of the machine shows as a run.
                "per_block": [round(x, 3) for x in per_block]})


def fanout_case(rank, world_size, backend_key, opts, cfg):
    names = ["caller"] + [f"w{i}" for i in range(1, world_size)]
    _init(rank, world_size, backend_key, opts, names)
    rows = []
    if rank == 0:
        one = torch.ones(1)
        def call():
            torch.futures.wait_all(
                [rpc.rpc_async(n, torch.add, args=(one, one)) for n in names[1:]])
        s = timed(call, cfg.iters // 4 or 1, cfg.warmup)
        rows.append({"case": f"fanout_{world_size - 1}", **summarize(s)})
    rpc.shutdown()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+",
                   default=["small", "pipelined", "many", "tensor", "fanout", "tcp"])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few iterations")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--repeats-large", type=int, default=5)
    p.add_argument("--pipelined", type=int, default=2000)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 400])
    p.add_argument("--many", type=int, default=1000,
                   help="the many case: this many 1 KiB tensors in one call")
    p.add_argument("--heavy-large", action="store_true")
    p.add_argument("--identity-only", action="store_true",
                   help="the tensor cases without the heavy ones (which take minutes at 64 MB)")
    p.add_argument("--fanout", type=int, default=8)
    p.add_argument("--grpc", action="store_true",
                   help="also run the tensor cases on the gRPC baseline (needs grpcio)")
    p.add_argument("--chart", type=Path, help="write a PNG chart of the ratios (matplotlib)")
    p.add_argument("--busy-poll-us", type=int,
                   help="TORCH_RPC_EXT's busy_poll_us (default: the option's default)")
    p.add_argument("--poll-on-caller-cpu", choices=["on", "off"],
                   help="TORCH_RPC_EXT's poll_on_caller_cpu (default: the option's "
                        "default, on where a process may run on at most 2 CPUs)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every backend this many times, alternating; ratios are "
                        "medians of the per-round ratios")
    p.add_argument("--call-costs-off", action="store_true",
                   help="also run ours with TORCH_RPC_EXT_CALL_COSTS=0 (no latency or size "
                        "histograms: torch_rpc_ext.metrics) and report on/off ratios")
    p.add_argument("--frame-ring-off", action="store_true",
                   help="also run ours with shm_frame_ring_bytes=0 (frames on the Unix "
                        "socket, as before frame rings) and report ring/socket ratios")
    p.add_argument("--inline", action="store_true",
                   help="also run ours with channels=(): tensors' bytes inline in the "
                        "connection's stream (cuda_staged's way on one host), through "
                        "the frame ring, and with --frame-ring-off on the socket too")
    p.add_argument("--interleave", type=int, metavar="BLOCKS",
                   help="the small and pipelined cases only, both backends' pairs up at "
                        "once taking turns, BLOCKS blocks of each case; ratios are medians "
                        "of the blocks' ratios")
    p.add_argument("--block-calls", type=int, default=200,
                   help="--interleave: small calls in a block")
    p.add_argument("--busy-loops", type=int, default=0, metavar="N",
                   help="run N busy loops (one process each) beside the workers for the "
                        "whole run: a host with no idle core, where every hand-off between "
                        "two processes waits for the scheduler; rows say busy_loops")
    p.add_argument("--gc", choices=["on", "freeze", "off"], default="on",
                   help="Python's garbage collector in every worker after init_rpc: as "
                        "Python sets it, gc.freeze() (what setup made is no longer walked), "
                        "or gc.disable(); rows say gc unless on (thousands of tensors a "
                        "call: docs/performance.md, \"Past that, Python's collector\")")
    p.add_argument("--out", type=Path)
    cfg = p.parse_args(argv)
    os.environ["RPC_BENCH_GC"] = cfg.gc  # (the workers inherit it)
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"])
            for _ in range(cfg.busy_loops)]
    try:
        run_plans(cfg)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def run_plans(cfg):
    backends_all, backends_tcp = dict(BACKENDS), dict(TCP_ONLY)
    if cfg.busy_poll_us is not None:
        for table in (backends_all, backends_tcp):
            key, opts = table["ext"]
            table["ext"] = (key, {**opts, "busy_poll_us": cfg.busy_poll_us})
    if cfg.poll_on_caller_cpu is not None:
        for table in (backends_all, backends_tcp):
            key, opts = table["ext"]
            table["ext"] = (key, {**opts, "poll_on_caller_cpu": cfg.poll_on_caller_cpu == "on"})
    if cfg.call_costs_off:
        for table in (backends_all, backends_tcp):
            key, opts = table["ext"]
            table["ext_costs_off"] = (key, {**opts, "_env": {"TORCH_RPC_EXT_CALL_COSTS": "0"}})
    if cfg.frame_ring_off:
        key, opts = backends_all["ext"]
        backends_all["ext_socket"] = (key, {**opts, "shm_frame_ring_bytes": 0})
    if cfg.inline:
        key, opts = backends_all["ext"]
        backends_all["ext_inline"] = (key, {**opts, "channels": ()})
        if cfg.frame_ring_off:
            backends_all["ext_inline_socket"] = (
                key, {**opts, "channels": (), "shm_frame_ring_bytes": 0})
    if cfg.smoke:
        cfg.iters, cfg.warmup, cfg.repeats, cfg.repeats_large = 20, 5, 3, 2
        cfg.pipelined, cfg.sizes_mb, cfg.fanout, cfg.block_calls = 50, [1], 2, 20
        cfg.many = 50
    out = cfg.out.open("w") if cfg.out else None

    def record(row):
        if cfg.busy_loops:
            row = {**row, "busy_loops": cfg.busy_loops}
        if cfg.gc != "on":
            row = {**row, "gc": cfg.gc}
        emit(row)
        if out:
            emit(row, out)

    if cfg.interleave:
        interleaved(cfg, {k: backends_all[k] for k in ("ext", "tensorpipe")}, record)
        return

    pair = [c for c in cfg.cases if c in ("small", "pipelined", "many", "tensor")]
    plans = []
    if pair:
        plans.append(("", backends_all,
                      lambda b, o: run_world(pair_cases, 2, b, o, pair, cfg)))
    if "tcp" in cfg.cases:
        plans.append(("tcp_", backends_tcp,
                      lambda b, o: run_world(pair_cases, 2, b, o, ["small"], cfg)))
    if "fanout" in cfg.cases:
        plans.append(("", backends_all,
                      lambda b, o: run_world(fanout_case, cfg.fanout + 1, b, o, cfg)))
    # Each round runs every backend once, alternating which goes first; a
    # ratio is the median of the per-round ratios, so a burst of noise from
    # a neighbour on a shared machine moves one round, not the result.
    runs: dict[tuple[str, str], list[dict]] = {}
    for prefix, backends, run in plans:
        for rnd in range(cfg.rounds):
            order = list(backends.items())
            if rnd % 2:
                order.reverse()
            for name, (key, opts) in order:
                rows, rss = run(key, opts)
                for row in rows:
                    row = {"backend": name, **row, "case": prefix + row["case"],
                           "peak_rss_mb": rss}
                    if cfg.rounds > 1:
                        row["round"] = rnd
                    runs.setdefault((row["case"], name), []).append(row)
                    record(row)
    if cfg.grpc and "tensor" in cfg.cases:
        import grpc_baseline

        grpc_cases = [(f, mb, n) for mb in cfg.sizes_mb for f in ("identity", "heavy")
                      for n in (1, 10)
                      if not (n == 10 and mb > 64)
                      and not (f == "heavy" and mb > 64 and not cfg.heavy_large)]
        rows, rss = run_world(grpc_baseline.world, 2, grpc_cases, cfg.repeats, 1)
        for case, samples in rows:
            row = {"backend": "grpc", "case": case, **summarize(samples), "peak_rss_mb": rss}
            runs[(case, "grpc")] = [row]
            record(row)
    # The row of each (case, backend) with the median time over rounds.
    results = {k: sorted(v, key=lambda r: r["median_us"])[len(v) // 2]
               for k, v in runs.items()}
    time_ratios: dict[str, float] = {}
    for case in sorted({c for c, _ in runs}):
        ext, grpc_row = results.get((case, "ext")), results.get((case, "grpc"))
        if ext and grpc_row:
            record({"case": case, "ratio": "speedup_ext_over_grpc",
                    "value": round(grpc_row["median_us"] / ext["median_us"], 1)})
        # What the histograms cost (ours with them over ours without), and
        # what frame rings buy (ours with them over ours on the socket; the
        # same for tensors carried inline).
        for on, other, kind in [
                ("ext", "ext_costs_off", "time_costs_on_over_off"),
                ("ext", "ext_socket", "time_ring_over_socket"),
                ("ext_inline", "ext_inline_socket", "time_inline_ring_over_socket")]:
            on_runs, off_runs = runs.get((case, on)), runs.get((case, other))
            if not (on_runs and off_runs):
                continue
            if "calls_per_s" in on_runs[0]:
                costs = [o["calls_per_s"] / e["calls_per_s"] for e, o in zip(on_runs, off_runs)]
            else:
                costs = [e["median_us"] / o["median_us"] for e, o in zip(on_runs, off_runs)]
            record({"case": case, "ratio": kind,
                    "value": round(statistics.median(costs), 3),
                    "per_round": [round(x, 3) for x in costs]})
        ext_runs, tp_runs = runs.get((case, "ext")), runs.get((case, "tensorpipe"))
        if not (ext_runs and tp_runs):
            continue
        if "calls_per_s" in ext_runs[0]:
            kind = "throughput_ext_over_tp"
            per_round = [e["calls_per_s"] / t["calls_per_s"] for e, t in zip(ext_runs, tp_runs)]
        else:
            kind = "time_ext_over_tp"
            per_round = [e["median_us"] / t["median_us"] for e, t in zip(ext_runs, tp_runs)]
        row = {"case": case, "ratio": kind,
               "value": round(statistics.median(per_round), 3)}
        # The chart shows time ratios (lower is better) for every case.
        time_ratios[case] = statistics.median(
            1 / x if kind.startswith("throughput") else x for x in per_round)
        if len(per_round) > 1:
            row["per_round"] = [round(x, 3) for x in per_round]
        record(row)
    if cfg.chart:
        chart(time_ratios, cfg.chart)


def chart(time_ratios: dict[str, float], path: Path) -> None:
    """Bar chart: time on TORCH_RPC_EXT / time on TensorPipe, per case
    (median over rounds; for throughput cases, TensorPipe's / ours)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted(time_ratios)
    values = [time_ratios[c] for c in cases]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(cases) + 1.5))
    colors = ["tab:green" if v < 1 else "tab:red" for v in values]
    ax.barh(cases, values, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("time on TORCH_RPC_EXT / time on TensorPipe (lower is better)")
    ax.set_title("TORCH_RPC_EXT vs TensorPipe, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
