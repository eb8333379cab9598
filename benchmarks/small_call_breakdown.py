# SPDX-License-Identifier: BSD-3-Clause
"""Where a small call's time goes, hand-off by hand-off (issue 48;
docs/performance.md, "A small call, hand-off by hand-off").

Two processes on one host. With TORCH_RPC_EXT_CALL_TRACE=1 the agent stamps
each call at its hand-offs (csrc/agent/call_trace.h) on the clock Python's
``time.perf_counter_ns`` reads, in both processes; the caller times each
``rpc_sync`` around it. Joined by call id, every call splits into:

  python_to_agent  API entry to our send (torch's frontend: pickling, C++)
  encode           the request's frame made
  write            the frame written (or queued) to the connection
  to_callee        to the whole request read by the callee's loop thread
  callee_dispatch  to the callee's thread starting the function
  callee_run       torch's request callback: unpickle, run, pickle
  respond          the response's frame made and written
  to_caller        to the whole response read by the caller's loop thread
  settle           to the call's future about to complete
  complete         completing it: its callbacks (torch's conversion of the
                   response into the caller's future) on our thread
  to_python        the waiting Python thread woken, back to the caller
                   (a stamp taken after the call returned counts as the
                   return: the thread completing a lone call may be
                   preempted by the waiter it woke before it stamps
                   `complete`; to_python is then 0)

and callee_run in two parts (rows with "part" and "of"):

  callee_call      torch's request callback running the function, to its
                   return (decode, run, and for a synchronous function the
                   result's future completed: a device-aware one records
                   its events)
  callee_result    from there to the response's start: an asynchronous
                   function's completion, and the responding callback's
                   setup (a device-aware future makes its streams wait)

(each from one stamp to the next: they add up to the whole; two taken by
different processes can cross on a busy host, the callee reading a request
before the caller's thread, preempted after its write, stamps it written,
so a run's to_callee may come out below 0 and its write that much longer)
for a builtin operator, a Python function and a TorchScript function, with
the floor beside it (a blocking ping-pong of a few bytes between two Python
processes over a Unix socket) and TensorPipe's round trip for each kind, in
one run. JSON lines: a row per kind and segment (the median in us, of the
rounds' medians with --rounds, and each round's), a row per kind's total
for each backend, the floor, and ratios (the median of the rounds').

    python benchmarks/small_call_breakdown.py [--calls 3000] [--warmup 300] [--rounds 5] \
        [--chart docs/img/small-call-breakdown.png]

--chart draws the segments as stacked bars per kind, coloured by whose code
runs in each (OWNER), with the floors as lines, and ours beside TensorPipe.
"""

import argparse
import bisect
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import emit, free_port  # noqa: E402

import torch_rpc_ext  # noqa: E402,F401  (registers the backend)

SEGMENTS = [
    ("python_to_agent", None, 0), ("encode", 0, 1), ("write", 1, 2), ("to_callee", 2, 3),
    ("callee_dispatch", 3, 4), ("callee_run", 4, 5), ("respond", 5, 6), ("to_caller", 6, 7),
    ("settle", 7, 8), ("complete", 8, 9), ("to_python", 9, None),
]
# Parts of a segment, through a stamp outside the chain (kServeReturned, 10):
# (name, from, to, the segment they split).
PARTS = [("callee_call", 4, 10, "callee_run"), ("callee_result", 10, 5, "callee_run")]
CHAIN = range(10)  # the stamps every whole call has
# Whose code each segment is (docs/performance.md's table): "ours" is what
# the floor per kind takes away; the transits stay (the kernel's socket and
# our loops' reads).
OWNER = {"python_to_agent": "torch", "encode": "ours", "write": "ours",
         "to_callee": "transit", "callee_dispatch": "ours", "callee_run": "torch",
         "respond": "ours", "to_caller": "transit", "settle": "ours",
         "complete": "torch", "to_python": "torch"}


def udf(x):
    return x


@torch.jit.script
def script_fn(x: torch.Tensor) -> torch.Tensor:
    return x


def take():
    from torch_rpc_ext import _C

    return _C._call_trace_take()


def calls_of(kind):
    one = torch.ones(1)
    if kind == "builtin":
        return lambda: rpc.rpc_sync("worker1", torch.add, args=(one, one))
    if kind == "python":
        return lambda: rpc.rpc_sync("worker1", udf, args=(one,))
    return lambda: rpc.rpc_sync("worker1", script_fn, args=(one,))


def worker(rank, port, backend, calls, warmup, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, backend=backend)
    if rank == 0:
        result = {}
        for kind in ("builtin", "python", "script"):
            call = calls_of(kind)
            for _ in range(warmup):
                call()
            traced = backend == rpc.BackendType.TORCH_RPC_EXT
            if traced:
                take()
                rpc.rpc_sync("worker1", take)
            windows = []
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                call()
                windows.append((t0, time.perf_counter_ns()))
            result[kind] = {"windows": windows,
                            "caller": take() if traced else [],
                            "callee": rpc.rpc_sync("worker1", take) if traced else []}
        out.put(result)
    rpc.shutdown()


def run_world(backend, calls, warmup):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, backend, calls, warmup, out))
             for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=900)
    for p in procs:
        p.join(60)
    return result


def by_id(stamps):
    calls = {}
    for id_, point, ns in stamps:
        calls.setdefault(id_, {})[point] = ns
    return calls


def breakdown(result):
    """Per segment, the per-call durations (us) of the calls whose every
    stamp came back."""
    caller, callee = by_id(result["caller"]), by_id(result["callee"])
    sent = sorted((points[0], id_) for id_, points in caller.items() if 0 in points)
    entries = [entry for entry, _ in sent]
    durations = {name: [] for name, _, _ in SEGMENTS + [p[:3] for p in PARTS]}
    totals = []
    for t0, t1 in result["windows"]:
        # The call whose send began inside this rpc_sync (calls are one at
        # a time; the rings' other calls, e.g. the one that cleared the
        # callee's, fall outside every window).
        k = bisect.bisect_left(entries, t0)
        if k == len(sent) or sent[k][0] > t1:
            continue
        id_ = sent[k][1]
        points = {**callee.get(id_, {}), **caller[id_]}
        if any(p not in points for p in CHAIN):
            continue
        ends = {None: None, **points}
        for name, a, b in SEGMENTS:
            # A stamp after the call returned reads as the return: the loop
            # thread completing a lone call shares the caller's CPU
            # (poll_on_caller_cpu), and the waiter it wakes often runs, and
            # returns, before that thread takes its `complete` stamp.
            start = t0 if a is None else min(ends[a], t1)
            end = t1 if b is None else min(ends[b], t1)
            durations[name].append((end - start) / 1e3)
        for name, a, b, _ in PARTS:
            if a in points and b in points:  # (not if the callback threw)
                durations[name].append((points[b] - points[a]) / 1e3)
        totals.append((t1 - t0) / 1e3)
    return durations, totals


def stats(xs):
    xs = sorted(xs)
    return {"median_us": round(statistics.median(xs), 2),
            "p90_us": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 2), "n": len(xs)}


def _recv(sock, spin):
    while True:
        try:
            return sock.recv(64, socket.MSG_DONTWAIT if spin else 0)
        except BlockingIOError:
            continue


def ping_pong(spin, n=5000):
    """The floor: a round trip of 8 bytes between two Python processes over
    a Unix socket, each end blocking in recv (woken by the kernel: on an
    idle VM a wake-up onto a halted vCPU is most of it) or spinning on it
    (no wake-up: what busy polling can reach)."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            while data := _recv(theirs, spin):
                theirs.sendall(data)
        finally:
            os._exit(0)
    theirs.close()
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        ours.sendall(b"12345678")
        _recv(ours, spin)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    ours.close()
    os.waitpid(pid, 0)
    return times[n // 10:]


def per_round_median(values):
    return round(statistics.median(values), 3) if values else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--chart", help="write a PNG of the segments (matplotlib)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternate ours and TensorPipe this many times; each row is "
                             "the median of the rounds' medians, with `per_round` (this "
                             "VM's speed drifts between minutes: one round can mislead)")
    args = parser.parse_args()
    os.environ["TORCH_RPC_EXT_CALL_TRACE"] = "1"  # inherited by the workers
    floor = stats(ping_pong(spin=False))
    emit({"case": "floor_unix_ping_pong", **floor})
    spinning = stats(ping_pong(spin=True))
    emit({"case": "floor_unix_ping_pong_spinning", **spinning})
    rounds, drawn = [], {}
    for _ in range(max(1, args.rounds)):
        ours = run_world(rpc.BackendType.TORCH_RPC_EXT, args.calls, args.warmup)
        tp = run_world(rpc.BackendType.TENSORPIPE, args.calls, args.warmup)
        rounds.append((ours, tp))
    for kind in ("builtin", "python", "script"):
        seg_rounds = {name: [] for name, _, _ in SEGMENTS}
        seg_n = {name: 0 for name, _, _ in SEGMENTS}
        part_rounds = {name: [] for name, _, _, _ in PARTS}
        totals_r, tp_r, sums_r, n_total = [], [], [], 0
        for ours, tp in rounds:
            durations, totals = breakdown(ours[kind])
            if not totals:
                raise SystemExit(f"no {kind} call came back whole: is the build's call trace on?")
            for name in part_rounds:
                if durations[name]:
                    part_rounds[name].append(statistics.median(durations[name]))
            for name, _, _ in SEGMENTS:
                seg_rounds[name].append(statistics.median(durations[name]))
                seg_n[name] += len(durations[name])
            totals_r.append(statistics.median(totals))
            n_total += len(totals)
            tp_r.append(statistics.median([(t1 - t0) / 1e3 for t0, t1 in tp[kind]["windows"]]))
            sums_r.append(sum(statistics.median(durations[name]) for name, _, _ in SEGMENTS))
        for name, _, _ in SEGMENTS:
            emit({"backend": "ext", "kind": kind, "segment": name,
                  "median_us": round(statistics.median(seg_rounds[name]), 2),
                  "per_round": [round(v, 2) for v in seg_rounds[name]], "n": seg_n[name]})
        for name, _, _, of in PARTS:
            per_round = part_rounds[name]
            if per_round:
                emit({"backend": "ext", "kind": kind, "part": name, "of": of,
                      "median_us": round(statistics.median(per_round), 2),
                      "per_round": [round(v, 2) for v in per_round]})
        total = round(statistics.median(totals_r), 2)
        tp_total = round(statistics.median(tp_r), 2)
        emit({"backend": "ext", "kind": kind, "segment": "total", "median_us": total,
              "per_round": [round(v, 2) for v in totals_r], "n": n_total})
        emit({"backend": "tensorpipe", "kind": kind, "segment": "total", "median_us": tp_total,
              "per_round": [round(v, 2) for v in tp_r]})
        ratios = [o / t for o, t in zip(totals_r, tp_r)]
        drawn[kind] = {"segments": {name: statistics.median(seg_rounds[name])
                                    for name, _, _ in SEGMENTS},
                       "total": total, "tensorpipe": tp_total,
                       "ratio": per_round_median(ratios)}
        emit({"kind": kind, "ratio": "time_ext_over_tp", "value": per_round_median(ratios),
              "per_round": [round(r, 3) for r in ratios]})
        emit({"kind": kind, "ratio": "time_ext_over_floor",
              "value": round(total / floor["median_us"], 2)})
        emit({"kind": kind, "ratio": "time_ext_over_spinning_floor",
              "value": round(total / spinning["median_us"], 2)})
        emit({"kind": kind, "ratio": "segments_median_sum_over_total",
              "value": per_round_median([sm / t for sm, t in zip(sums_r, totals_r)])})
    if args.chart:
        chart(drawn, floor["median_us"], spinning["median_us"], args.chart)


def chart(drawn, floor_us, spinning_us, path):
    """Left: ours per kind, its segments stacked in order and coloured by
    whose code runs (a segment whose median came out below 0 on a busy
    host is drawn as 0), with the two ping-pong floors and the floor per
    kind (the whole less what is ours). Right: ours beside TensorPipe's
    round trip, and issue 48's 0.15x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"torch": "tab:gray", "ours": "tab:blue", "transit": "tab:orange"}
    labels = {"torch": "torch (frontend, request callback, future)",
              "ours": "ours (encode, write, dispatch, respond, settle)",
              "transit": "the wire: kernel socket + our loop's read"}
    kinds = [k for k in ("builtin", "python", "script") if k in drawn]
    names = {"builtin": "builtin", "python": "Python UDF", "script": "TorchScript"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 1.1 * len(kinds) + 3.2),
                                      gridspec_kw={"width_ratios": [3, 1.4]})
    shown = set()
    for y, kind in enumerate(kinds):
        x = 0.0
        for name, _, _ in SEGMENTS:
            width = max(0.0, drawn[kind]["segments"][name])
            owner = OWNER[name]
            left.barh(y, width, left=x, color=colors[owner], edgecolor="white",
                      label=None if owner in shown else labels[owner])
            shown.add(owner)
            if width >= 2.5:
                left.text(x + width / 2, y, name.replace("_", "\n", 1), ha="center",
                          va="center", fontsize=6, color="white")
            x += width
        ours = sum(max(0.0, drawn[kind]["segments"][n]) for n, _, _ in SEGMENTS
                   if OWNER[n] == "ours")
        floor_kind = x - ours
        left.plot([floor_kind, floor_kind], [y - 0.45, y + 0.45], color="black", linewidth=2)
        left.text(x + 0.5, y, f"{drawn[kind]['total']:.1f} us (floor {floor_kind:.1f})",
                  va="center", fontsize=8)
    left.axvline(spinning_us, color="tab:green", linestyle="--",
                 label=f"spinning ping-pong {spinning_us:.1f} us")
    left.axvline(floor_us, color="tab:red", linestyle=":",
                 label=f"blocking ping-pong {floor_us:.1f} us")
    left.plot([], [], color="black", linewidth=2, label="floor per kind: the whole less ours")
    left.set_yticks(range(len(kinds)), [names[k] for k in kinds])
    left.invert_yaxis()
    left.set_xlabel("us per round trip (medians of the segments)")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    left.set_title("A small rpc_sync, hand-off by hand-off (TORCH_RPC_EXT)", fontsize=10)
    height = 0.38
    for y, kind in enumerate(kinds):
        right.barh(y - height / 2, drawn[kind]["total"], height=height, color="tab:blue",
                   label="TORCH_RPC_EXT" if y == 0 else None)
        right.barh(y + height / 2, drawn[kind]["tensorpipe"], height=height, color="tab:gray",
                   label="TensorPipe" if y == 0 else None)
        right.plot([0.15 * drawn[kind]["tensorpipe"]] * 2, [y - 0.45, y + 0.05], color="tab:red",
                   linewidth=1.5, label="0.15x TensorPipe" if y == 0 else None)
        right.text(drawn[kind]["tensorpipe"], y + height / 2, f" {drawn[kind]['ratio']:.2f}x",
                   va="center", fontsize=8)
    right.set_yticks(range(len(kinds)), [names[k] for k in kinds])
    right.invert_yaxis()
    right.set_xlim(0, 1.25 * max(drawn[k]["tensorpipe"] for k in kinds))
    right.set_xlabel("us per round trip")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    right.set_title("ours / TensorPipe, same run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
