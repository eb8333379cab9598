# SPDX-License-Identifier: BSD-3-Clause
"""Elastic soak: workers join, leave and are killed at random while the rest
keep calling each other (docs/elastic.md, docs/reliability.md).

A controller keeps ``--workers`` slots (worker names ``w<slot>``, rank =
slot) of a dynamic group (``init_rpc`` without ``world_size``, one file
store). Every ``--period`` seconds it picks a live worker other than ``w0``
and either kills it (SIGKILL) or asks it to leave (``rpc.shutdown()``), and
starts a fresh process on an empty slot, with the departed one's name and
rank. ``w0`` stays to the end and its RSS is sampled throughout.

Every live worker runs a loop of steps against random current members:
``rpc_async(w, echo, (seq,))`` in windows of 8 (each answer must be its own
``seq``), an ``rpc.remote`` + ``to_here``, and a dist autograd step
(``rpc_sync(w, torch.mul, ...)`` then ``backward``). Each call ends in one of:
ok; wrong (an answer that is not the call's own: corruption or a crossed
response); failed naming its target (the target departed: expected); failed
otherwise (a bug); or still pending at the end (lost).

  python benchmarks/elastic_soak.py --workers 16 --duration 180     # the issue's run
  python benchmarks/elastic_soak.py --workers 4 --duration 15       # a smoke
  python benchmarks/elastic_soak.py --backend TENSORPIPE ...        # the same churn on TensorPipe

Prints one JSON line per backend run with the totals, and what the churn
left in the store (``store``: live keys, and the file's bytes).

Nothing the controller shares with a worker holds a lock: a process killed
inside ``multiprocessing.Event.is_set()`` leaves the event's lock held (the
next ``set()`` then blocks forever), and one killed while its queue feeder
holds the queue's write lock stops every other writer. So the stop and leave
flags are lock-free shared bytes, and each worker writes its reports to files
of its own.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import rss_mb  # noqa: E402

_ctx = mp.get_context("fork")


def echo(seq):
    return seq


def make_tensor(seq):
    return torch.full((4,), float(seq))


def _members():
    agent = rpc.api._get_current_rpc_agent()
    return [w.name for w in agent.get_worker_infos()]


def _report(store_path, slot, kind, row):
    # One file per report, made whole by a rename: a worker killed while
    # writing leaves only a .tmp the controller ignores.
    path = os.path.join(os.path.dirname(store_path), f"report-{slot}-{os.getpid()}-{kind}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"slot": slot, **row}, f)
    os.replace(path + ".tmp", path)


def worker(slot, backend, store_path, leave, stop, timeout):
    import torch.distributed.autograd as dist_autograd

    import torch_rpc_ext

    name = f"w{slot}"
    tally = {"ok": 0, "wrong": 0, "named": 0, "unnamed": 0, "lost": 0, "steps": 0}
    unnamed = []
    kinds = {}
    rss = []
    try:
        if backend == "TORCH_RPC_EXT":
            options = torch_rpc_ext.RpcExtBackendOptions(
                init_method=f"file://{store_path}", rpc_timeout=timeout,
                address="127.0.0.1", num_worker_threads=4, heartbeat_timeout=2.0)
        else:
            options = rpc.TensorPipeRpcBackendOptions(
                init_method=f"file://{store_path}", rpc_timeout=timeout, num_worker_threads=4)
        rpc.init_rpc(name, rank=slot, backend=getattr(rpc.BackendType, backend),
                     rpc_backend_options=options)
    except Exception as e:  # noqa: BLE001
        _report(store_path, slot, "init", {"init_error": f"{type(e).__name__}: {e}"[:300]})
        return
    _report(store_path, slot, "joined", {"joined": time.monotonic()})
    rng = random.Random(slot * 7919 + os.getpid())
    seq = 0

    def failed(target, e, what):
        # A failure must name a worker: the one it was for, or (a dist
        # autograd pass that went through several) the one it failed at.
        text = str(e)
        kind = re.sub(r"w\d+", "W", re.sub(r"[@:][\w.-]+|\d+", "N", text.split("\n")[0]))[:90]
        kinds[f"{what}: {kind}"] = kinds.get(f"{what}: {kind}", 0) + 1
        if target in text or re.search(r"RPC to w\d+ failed", text):
            tally["named"] += 1
        else:
            tally["unnamed"] += 1
            if len(unnamed) < 5:
                unnamed.append(f"{target} ({what}): {text[:200]}")

    def settle(fut, target, expected, check):
        try:
            value = fut.wait()
        except Exception as e:  # noqa: BLE001
            failed(target, e, "call")
            return
        tally["ok" if check(value, expected) else "wrong"] += 1

    next_rss = 0.0
    while not stop.value and not leave.value:
        peers = [m for m in _members() if m != name] or [name]
        target = rng.choice(peers)
        futs = []
        try:
            for _ in range(8):
                seq += 1
                futs.append((rpc.rpc_async(target, echo, (seq,)), seq))
        except Exception as e:  # noqa: BLE001  (raised by the send itself)
            failed(target, e, "rpc_async")
        for fut, s in futs:
            settle(fut, target, s, lambda v, s: v == s)
        try:
            seq += 1
            rref = rpc.remote(target, make_tensor, (seq,))
            value = rref.to_here()
            tally["ok" if bool((value == seq).all()) else "wrong"] += 1
            del rref
        except Exception as e:  # noqa: BLE001
            failed(target, e, "rref")
        try:
            with dist_autograd.context() as ctx:
                t = torch.ones(2, requires_grad=True)
                out = rpc.rpc_sync(target, torch.mul, (t, 3.0))
                dist_autograd.backward(ctx, [out.sum()])
                grads = dist_autograd.get_gradients(ctx)
                tally["ok" if bool((grads[t] == 3).all()) else "wrong"] += 1
        except Exception as e:  # noqa: BLE001
            failed(target, e, "autograd")
        tally["steps"] += 1
        if slot == 0 and time.monotonic() >= next_rss:
            rss.append(round(rss_mb(), 1))
            next_rss = time.monotonic() + 2.0
    t0 = time.monotonic()
    try:
        rpc.shutdown()
        shutdown = {"shutdown_s": round(time.monotonic() - t0, 2)}
    except Exception as e:  # noqa: BLE001
        shutdown = {"shutdown_error": str(e)[:300]}
    _report(store_path, slot, "end",
            {"tally": tally, "unnamed": unnamed, "kinds": kinds, "rss": rss, **shutdown})


def _store_left(store_path):
    """What the churn left in the group's store: its live keys (a TCPStore
    would hold these in memory) and the file's size (a FileStore appends
    every write and deletion, and never shrinks)."""
    if not os.path.exists(store_path):
        return None
    size = os.path.getsize(store_path)
    import torch.distributed as dist

    return {"keys": dist.FileStore(store_path, -1).num_keys(), "file_bytes": size}


def soak(backend, workers, duration, period, timeout, seed):
    rng = random.Random(seed)
    store_dir = tempfile.mkdtemp(prefix="elastic_soak_")
    store_path = os.path.join(store_dir, "store")
    stop = _ctx.RawValue("b", 0)
    procs = {}  # slot -> (process, leave flag)

    def start(slot):
        leave = _ctx.RawValue("b", 0)
        p = _ctx.Process(target=worker, args=(slot, backend, store_path, leave, stop, timeout))
        p.start()
        procs[slot] = (p, leave)

    for slot in range(workers):
        start(slot)
        time.sleep(0.1)
    events = {"kill": 0, "leave": 0, "start": 0}
    t_end = time.monotonic() + duration
    while time.monotonic() < t_end:
        time.sleep(period)
        candidates = [s for s, (p, _) in procs.items() if s != 0 and p.is_alive()]
        if candidates:
            slot = rng.choice(candidates)
            p, leave = procs[slot]
            if rng.random() < 0.5:
                os.kill(p.pid, signal.SIGKILL)
                events["kill"] += 1
            else:
                leave.value = 1
                events["leave"] += 1
        for slot, (p, _) in list(procs.items()):
            if not p.is_alive():
                p.join()
                start(slot)  # the departed one's name and rank
                events["start"] += 1
    stop.value = 1
    deadline = time.monotonic() + 3 * timeout + 30
    for p, _ in procs.values():
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [s for s, (p, _) in procs.items() if p.is_alive()]
    for s in hung:
        procs[s][0].kill()
    totals = {"ok": 0, "wrong": 0, "named": 0, "unnamed": 0, "steps": 0}
    init_errors, unnamed, shutdown_errors, rss = [], [], [], []
    kinds = {}
    for path in sorted(Path(store_dir).glob("report-*.json")):
        r = json.loads(path.read_text())
        if "init_error" in r:
            init_errors.append(r["init_error"])
        if "tally" in r:
            for k in totals:
                totals[k] += r["tally"].get(k, 0)
            unnamed += r["unnamed"]
            for k, n in r["kinds"].items():
                kinds[k] = kinds.get(k, 0) + n
            if r["slot"] == 0:
                rss = r["rss"]
        if "shutdown_error" in r:
            shutdown_errors.append(r["shutdown_error"])
    store = _store_left(store_path)
    shutil.rmtree(store_dir, ignore_errors=True)
    return {
        "backend": backend, "workers": workers, "duration_s": duration,
        "churn": events, **totals,
        "init_errors": len(init_errors), "init_error_examples": init_errors[:3],
        "unnamed_examples": unnamed[:5], "shutdown_errors": shutdown_errors[:3],
        "failure_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:8]),
        "hung_at_end": hung,
        "store": store,
        "w0_rss_mb": {"first": rss[0] if rss else None, "last": rss[-1] if rss else None,
                      "max": max(rss) if rss else None, "samples": len(rss)},
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--duration", type=float, default=180)
    p.add_argument("--period", type=float, default=3.0,
                   help="seconds between churn events")
    p.add_argument("--timeout", type=float, default=10.0, help="rpc_timeout")
    p.add_argument("--backend", nargs="+", default=["TORCH_RPC_EXT", "TENSORPIPE"],
                   choices=["TORCH_RPC_EXT", "TENSORPIPE"])
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    import torch_rpc_ext  # noqa: F401  (registers the backend before forking)

    for backend in args.backend:
        row = soak(backend, args.workers, args.duration, args.period, args.timeout, args.seed)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
