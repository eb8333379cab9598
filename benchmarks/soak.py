# SPDX-License-Identifier: BSD-3-Clause
"""Soak: N workers exchange small RPCs with a window of calls in flight each.

Every worker calls every other worker round-robin with
``rpc_async(dst, torch.add, (tensor([seq]), 0))`` keeping ``--window`` calls in
flight, and checks that each answer is its own ``seq`` (a lost response would
leave a future unfinished, a duplicated or crossed one would show up as a
wrong value or in ``rpc_ext.late_responses``). RSS is sampled after warm-up
(10% of the calls) and at the end. Then each worker issues ``--at-shutdown``
more calls and calls ``rpc.shutdown()`` (graceful) at once: all of them must
complete.

  python benchmarks/soak.py --workers 4 --calls 1000000 --window 256   # the issue's run
  python benchmarks/soak.py --workers 4 --calls 20000                  # CI's short run
  python benchmarks/soak.py --workers 4 --calls 200000 --tensor-kb 256  # through shm slabs

``--tensor-kb K`` sends K KiB tensors filled with ``seq`` instead (64 KiB or
more go through the shm transport's shared slabs) and checks every element.

Prints one JSON line with totals and per-worker figures.
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch
from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import rss_mb, run_world_all  # noqa: E402


def soak(rank, world_size, calls, window, at_shutdown, tensor_kb=0):
    import torch_rpc_ext

    rpc.init_rpc(
        f"w{rank}", rank=rank, world_size=world_size,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
            address="127.0.0.1", rpc_timeout=120, num_worker_threads=4),
    )
    peers = [f"w{r}" for r in range(world_size) if r != rank]
    mine = calls // world_size
    slots = threading.Semaphore(window)
    lock = threading.Lock()
    tally = {"ok": 0, "wrong": 0, "error": 0}
    done = threading.Event()
    remaining = [mine]
    numel = max(1, tensor_kb * 1024 // 8)

    def payload(seq):
        return torch.full((numel,), seq, dtype=torch.int64)

    def right(value, seq):
        return value.numel() == numel and bool((value == seq).all())

    def finished(fut, seq):
        try:
            ok = right(fut.value(), seq)
            key = "ok" if ok else "wrong"
        except Exception:  # noqa: BLE001 - counted, reported
            key = "error"
        with lock:
            tally[key] += 1
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()
        slots.release()

    warm_rss = None
    t0 = time.monotonic()
    for seq in range(mine):
        if seq == mine // 10:
            warm_rss = rss_mb()
        slots.acquire()
        fut = rpc.rpc_async(peers[seq % len(peers)], torch.add,
                            args=(payload(seq), 0))
        fut.add_done_callback(lambda f, seq=seq: finished(f, seq))
    all_done = done.wait(timeout=600)
    elapsed = time.monotonic() - t0
    end_rss = rss_mb()
    late = int(rpc.api._get_current_rpc_agent().get_metrics()["rpc_ext.late_responses"])

    # Graceful shutdown with calls in flight: every one must complete.
    futs = [rpc.rpc_async(peers[k % len(peers)], torch.add,
                          args=(payload(k), 0))
            for k in range(at_shutdown)]
    rpc.shutdown()
    drained = 0
    for k, f in enumerate(futs):
        try:
            drained += int(f.done() and right(f.value(), k))
        except Exception:  # noqa: BLE001 - counted as not drained
            pass
    return {"calls": mine, **tally, "unfinished": remaining[0], "all_done": all_done,
            "late_responses": late, "seconds": round(elapsed, 1),
            "calls_per_s": round(mine / elapsed), "rss_warm_mb": round(warm_rss, 1),
            "rss_end_mb": round(end_rss, 1),
            "rss_growth": round((end_rss - warm_rss) / warm_rss, 4),
            "at_shutdown": at_shutdown, "drained_at_shutdown": drained}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--calls", type=int, default=1_000_000, help="in total, over all workers")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--at-shutdown", type=int, default=250, help="per worker")
    p.add_argument("--tensor-kb", type=int, default=0,
                   help="KiB per tensor (0: one int64)")
    args = p.parse_args(argv)
    results, peak = run_world_all(soak, args.workers, args.calls, args.window,
                                  args.at_shutdown, args.tensor_kb, timeout=7200)
    per = [results[r] for r in sorted(results)]
    total = {
        "workers": args.workers, "window": args.window, "tensor_kb": args.tensor_kb,
        "calls": sum(r["calls"] for r in per), "ok": sum(r["ok"] for r in per),
        "wrong": sum(r["wrong"] for r in per), "errors": sum(r["error"] for r in per),
        "unfinished": sum(r["unfinished"] for r in per),
        "late_responses": sum(r["late_responses"] for r in per),
        "max_rss_growth": max(r["rss_growth"] for r in per),
        "calls_per_s_total": sum(r["calls_per_s"] for r in per),
        "in_flight_at_shutdown": sum(r["at_shutdown"] for r in per),
        "drained_at_shutdown": sum(r["drained_at_shutdown"] for r in per),
        "peak_rss_mb": peak, "per_worker": per,
    }
    print(json.dumps(total))
    clean = (total["ok"] == total["calls"] and total["unfinished"] == 0
             and total["late_responses"] == 0
             and total["drained_at_shutdown"] == total["in_flight_at_shutdown"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
