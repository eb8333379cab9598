# SPDX-License-Identifier: BSD-3-Clause
"""TORCH_RPC_EXT (TLS on, TLS off) vs TensorPipe across two hosts, on shaped links.

The two "hosts" are Linux network namespaces joined by a bridge
(tests/crosshost/netns.py), so every byte leaves one network stack and
arrives at another, as between machines, and each host's link can be held
to a rate with a tc tbf qdisc (netem is not available on every kernel; tbf
is). This is the benchmark that shows what encryption costs: between hosts
TORCH_RPC_EXT encrypts by default (``encryption="auto"`` encrypts every peer
whose address is not loopback), which rpc_bench.py, on one host, never does.

Backends (all three in one run, side by side, on the same links):
  ext_tls     TORCH_RPC_EXT, the default encryption="auto" (TLS 1.3)
  ext_clear   TORCH_RPC_EXT, encryption="off"
  ext_tls_libcrypto   ext_tls with TORCH_RPC_EXT_AES_GCM=libcrypto: the
              lanes' records sealed by libcrypto's AES-GCM, not by our VAES
              code (only when --backends names it; a ratio line too)
  ext_tls_lanes, ext_clear_lanes   the same with the tcp_lanes channel:
              tensors of 1 MiB or more striped over 4 TCP lanes per peer
              (only when --backends names them; they get ratio lines too)
  tensorpipe  TensorPipe, _transports=["uv"], the channels it uses between
              machines: _channels=["mpt_uv", "basic"]
and, only when --backends names them (no ratio lines; compare their rows):
  tensorpipe_basic    TensorPipe with _channels=["basic"]: tensors in the
                      uv connection itself, no mpt_uv lanes (which cost
                      small calls most of a millisecond on a small VM)
  tensorpipe_default  TensorPipe's default channels, whose cma channel
                      (process_vm_readv) sees one kernel and one PID
                      namespace and so copies tensors straight between the
                      two processes, past the link: possible on one machine,
                      not across two, hence not the comparison (its "run"
                      line says link_bypassed)

For each rate (default: unshaped, 10gbit, 25gbit, 100gbit), both hosts'
links are shaped (tbf with a bucket of --burst-ms of traffic, 0.25 ms by
default: a transfer that fits in the bucket after an idle moment goes at
full speed, so a big bucket would let 1 MB calls beat the rate), then each
backend runs as one pair of worker processes,
worker0 on host 0 and worker1 on host 1 (rendezvous on host 0's address);
worker0 runs every case against worker1:
  first_call    the first rpc_sync (a 4-byte tensor), which dials: TCP,
                for ours the key exchange before TLS and TLS 1.3 (none in
                the clear) and the group's handshake; one sample per run
                (take --rounds for a median)
  rtt_<size>    rpc_sync of identity(tensor) with 1KB, 64KB, 1MB, 16MB and
                64MB tensors (1KB is the small-call latency case); median
                and p90 ms, and gbit_s = 2 x size x 8 / median, the rate at
                which the link carries the request and then the reply.
  pipelined_1MB 64 rpc_async identity(1 MB) in flight, in batches; calls/s
                and gbit_s each way (1 MB goes out and 1 MB comes back per
                call, both directions at once).

Output: JSON lines, one per (rate, backend, case), e.g.
  {"bench": "crosshost", "rate": "10gbit", "backend": "ext_tls",
   "case": "rtt_1MB", "median_ms": ..., "p90_ms": ..., "gbit_s": ...}
one "run" line per worker pair (init seconds, which security the ext
connection reported, and the megabytes that crossed host 0's interface, so
that a backend whose bytes bypass the link would show; for ours, the
tcp_lanes counters lane_segments, lanes_opened and lanes_failed), then one ratio line
per (rate, case) and TORCH_RPC_EXT variant:
  {"bench": "crosshost", "rate": "10gbit", "case": "rtt_1MB",
   "ratio": "ext_tls_vs_tensorpipe", "value": 1.3}
where value is TensorPipe's median time / ours (for pipelined, our calls/s /
TensorPipe's): above 1 means ours is faster. With --rounds N every backend
runs N times per rate, alternating which goes first, and a ratio is the
median of the N per-round ratios (printed as per_round).

A backend whose 1 MB tensors stripe over tcp_lanes (ext_tls, by default
on an encrypted connection, and the *_lanes variants) first sends 1 MB
calls until one has gone over the lanes (at most 30 s; its run line's
lane_warmup_calls counts them). The first such tensor dials the lanes, and
until they are up tensors ride the connection's stream: without the
warm-up, a loaded host's timed calls could all go that way.

Needs root and iproute2 (ip, tc); exits 2 with a message otherwise.

Examples:
  sudo .venv/bin/python benchmarks/crosshost_bench.py             # ~1 min per round
  sudo .venv/bin/python benchmarks/crosshost_bench.py --smoke     # ~20 s
  sudo .venv/bin/python benchmarks/crosshost_bench.py --rates unshaped 10gbit \\
      --backends ext_tls tensorpipe --rounds 3 --out x.jsonl --chart x.png
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(ROOT))  # a source checkout works without installing
from _harness import emit, summarize, timed  # noqa: E402

KB, MB = 1024, 1024 * 1024
RATES = ["unshaped", "10gbit", "25gbit", "100gbit"]
# name -> ("ext", RpcExtBackendOptions keywords) or ("tensorpipe", _channels).
# TensorPipe's default channels include cma (process_vm_readv), which only
# checks for one kernel and one PID namespace: between these namespace hosts
# it would move every tensor without touching the link, which no two real
# machines can do. "tensorpipe" therefore names the channels TensorPipe uses
# between machines (its defaults but cma: mpt_uv, several TCP lanes, and
# basic, in the uv connection); "tensorpipe_basic" leaves out mpt_uv too;
# "tensorpipe_default" keeps cma, for reference only (its run line shows
# the link carrying almost nothing).
LANES = ("shm_slab", "shm_ring", "tcp_lanes")
BACKENDS = {"ext_tls": ("ext", {"encryption": "auto"}),
            "ext_clear": ("ext", {"encryption": "off"}),
            "ext_tls_lanes": ("ext", {"encryption": "auto", "channels": LANES}),
            "ext_clear_lanes": ("ext", {"encryption": "off", "channels": LANES}),
            "ext_tls_libcrypto": ("ext", {"encryption": "auto"}),
            "tensorpipe": ("tensorpipe", ["mpt_uv", "basic"]),
            "tensorpipe_basic": ("tensorpipe", ["basic"]),
            "tensorpipe_default": ("tensorpipe", None)}
DEFAULT_BACKENDS = ["ext_tls", "ext_clear", "tensorpipe"]
# Environment a backend's workers get on top of the parent's.
BACKEND_ENV = {"ext_tls_libcrypto": {"TORCH_RPC_EXT_AES_GCM": "libcrypto"}}
EXT = [b for b, (kind, _) in BACKENDS.items() if kind == "ext"]
# (label, bytes, iterations, warm-up): fewer iterations as sizes grow.
FULL_RTT = [("1KB", KB, 300, 30), ("64KB", 64 * KB, 100, 10), ("1MB", MB, 40, 5),
            ("16MB", 16 * MB, 10, 2), ("64MB", 64 * MB, 5, 1)]
SMOKE_RTT = [("1KB", KB, 20, 3), ("64KB", 64 * KB, 10, 2), ("1MB", MB, 5, 1)]
# (label, bytes per call, calls in flight, timed batches)
FULL_PIPELINED = ("1MB", MB, 64, 6)
SMOKE_PIPELINED = ("64KB", 64 * KB, 8, 2)
BASE_PORT = 29500  # fresh namespaces: nothing else listens there
# Variables that would override what this benchmark sets per backend.
STRIP_ENV = ("TORCH_RPC_EXT_TRANSPORTS", "TORCH_RPC_EXT_CHANNELS", "TORCH_RPC_EXT_ADDR", "TORCH_RPC_EXT_SOCKET_IFNAME",
             "TORCH_RPC_EXT_ENCRYPTION", "TORCH_RPC_EXT_TLS_CERT", "TORCH_RPC_EXT_TLS_KEY",
             "TORCH_RPC_EXT_TLS_CA", "TORCH_RPC_EXT_AES_GCM")


# The worker side: one process per host, started by the parent through
# Hosts.run with --worker CONFIG (JSON).

def worker_main(cfg: dict) -> None:
    import torch
    from torch.distributed import rpc

    import torch_rpc_ext

    rank = cfg["rank"]
    out = {"rank": rank}
    try:
        t0 = time.monotonic()
        common = {"init_method": f"tcp://{cfg['master']}:{cfg['port']}",
                  "rpc_timeout": cfg["rpc_timeout"], "num_worker_threads": 16}
        kind, extra = cfg["backend"]
        if kind == "tensorpipe":
            options = rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=extra,
                                                      **common)
            backend = rpc.BackendType.TENSORPIPE
        else:
            options = torch_rpc_ext.RpcExtBackendOptions(address=cfg["address"], **common,
                                                         **extra)
            backend = rpc.BackendType.TORCH_RPC_EXT
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, backend=backend,
                     rpc_backend_options=options)
        out["init_s"] = round(time.monotonic() - t0, 2)
        if rank == 0:
            out.update(drive(cfg, torch, rpc))
        t0 = time.monotonic()
        rpc.shutdown()
        out["shutdown_s"] = round(time.monotonic() - t0, 2)
    except BaseException:
        import traceback

        out["error"] = traceback.format_exc()
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(1)  # the peer may be gone: no graceful shutdown to wait for
    print("RESULT " + json.dumps(out), flush=True)


def drive(cfg: dict, torch, rpc) -> dict:
    """Worker0's cases against worker1; rows of times in ms."""
    from _workloads import identity

    dst = "worker1"
    # The first call dials: TCP, for ours the key exchange and TLS 1.3 (or
    # nothing, in the clear) and the group's handshake, then the call.
    t0 = time.perf_counter()
    rpc.rpc_sync(dst, identity, args=(torch.ones(1),))
    out: dict = {"rows": [{"case": "first_call", "bytes": 4,
                           **in_ms([time.perf_counter() - t0])}]}
    if cfg["backend"][0] == "ext":
        info = rpc.api._get_current_rpc_agent().get_debug_info()
        out["transport"] = info.get(f"rpc_ext.peer.{dst}.transport")
        out["security"] = info.get(f"rpc_ext.peer.{dst}.security")
    payload = 0
    if cfg.get("lanes"):
        # The first striped segment dials the lanes; until all are up, such
        # segments ride the connection's stream. Timed calls start once the
        # lanes carry them (a loaded host can take longer to dial than a
        # smoke run's few 1 MiB calls last).
        out["lane_warmup_calls"], nbytes = 0, MB  # tcp_lanes' default least size
        x = torch.rand(nbytes // 4)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lanes = lane_counters(rpc)
            if lanes.get("segments", 0) or lanes.get("lanes_failed", 0):
                break  # (a failed dial: the stream from now on, said in the run row)
            rpc.rpc_sync(dst, identity, args=(x,))
            out["lane_warmup_calls"] += 1
            payload += nbytes
    for label, nbytes, iters, warmup in cfg["rtt"]:
        x = torch.rand(nbytes // 4)  # float32
        back = rpc.rpc_sync(dst, identity, args=(x,))
        if not torch.equal(back, x):
            raise AssertionError(f"rtt_{label}: the tensor came back changed")
        s = timed(lambda x=x: rpc.rpc_sync(dst, identity, args=(x,)), iters, warmup)
        payload += nbytes * (iters + warmup + 1)
        out["rows"].append({"case": f"rtt_{label}", "bytes": nbytes, **in_ms(s),
                            "gbit_s": round(2 * nbytes * 8 / statistics.median(s) / 1e9, 3)})
    label, nbytes, inflight, batches = cfg["pipelined"]
    x = torch.rand(nbytes // 4)

    def batch():
        torch.futures.wait_all([rpc.rpc_async(dst, identity, args=(x,))
                                for _ in range(inflight)])

    s = timed(batch, batches, 1)
    payload += nbytes * inflight * (batches + 1)
    med = statistics.median(s)
    out["rows"].append({"case": f"pipelined_{label}", "bytes": nbytes, "inflight": inflight,
                        **in_ms(s), "calls_s": round(inflight / med, 1),
                        "gbit_s": round(inflight * nbytes * 8 / med / 1e9, 3)})
    out["payload_mb"] = round(payload / MB, 1)  # each way
    if cfg["backend"][0] == "ext":
        # Tensors striped over tcp_lanes (by default on encrypted
        # connections), this end's.
        lanes = lane_counters(rpc)
        out["lane_segments"] = lanes.get("segments", 0)
        out["lanes_opened"] = lanes.get("lanes_opened", 0)
        out["lanes_failed"] = lanes.get("lanes_failed", 0)
        # 1: the lanes' records went through our VAES AES-GCM (crypto.h).
        out["aes_gcm_vaes"] = lanes.get("aes_gcm_vaes", 0)
    return out


def lane_counters(rpc) -> dict:
    """This worker's tcp_lanes counters, without their prefix."""
    prefix = "rpc_ext.channel.tcp_lanes."
    metrics = rpc.api._get_current_rpc_agent().get_metrics()
    return {k[len(prefix):]: int(v) for k, v in metrics.items()
            if k.startswith(prefix) and str(v).isdigit()}


def in_ms(samples_s: list[float]) -> dict:
    """_harness.summarize's median and p90, in milliseconds."""
    s = summarize(samples_s)
    return {"median_ms": round(s["median_us"] / 1000, 3), "p90_ms": round(s["p90_us"] / 1000, 3),
            "n": s["n"]}


# The parent side: namespaces, shaping, one worker pair per backend.

def link_bytes(hosts, i: int) -> tuple[int, int]:
    """(tx, rx) bytes of host i's interface so far."""
    r = subprocess.run(["ip", "-n", hosts.ns(i), "-j", "-s", "link", "show", "dev",
                        hosts.ifname(i)], capture_output=True, text=True, timeout=30, check=True)
    stats = json.loads(r.stdout)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


def stripes(backend: str) -> bool:
    """Whether backend's 1 MiB tensors go over tcp_lanes between these
    hosts: named in its channels, or by default on an encrypted connection."""
    kind, extra = BACKENDS[backend]
    return kind == "ext" and ("tcp_lanes" in extra.get("channels", ())
                              or extra.get("encryption") == "auto")


def run_pair(hosts, backend: str, port: int, plan: dict, logdir: Path,
             deadline_s: float) -> dict:
    """Start worker0 on host 0 and worker1 on host 1 for backend, wait for
    both (or the deadline), kill what is left; worker0's RESULT, with an
    "error" key if the pair did not finish cleanly."""
    procs, logs = [], []
    before = link_bytes(hosts, 0)
    t0 = time.monotonic()
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if k not in STRIP_ENV}
        # TensorPipe and Gloo pick their interface by name (without it,
        # TensorPipe resolves the hostname and hangs at start); the same for
        # every backend does no harm.
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   TP_SOCKET_IFNAME=hosts.ifname(rank), GLOO_SOCKET_IFNAME=hosts.ifname(rank))
        env.update(BACKEND_ENV.get(backend, {}))
        cfg = {"rank": rank, "master": hosts.ipv4(0), "port": port,
               "address": hosts.ipv4(rank), "backend": BACKENDS[backend],
               "rpc_timeout": max(60, int(deadline_s)), "lanes": stripes(backend), **plan}
        out, err = logdir / f"{backend}-{port}-w{rank}.out", logdir / f"{backend}-{port}-w{rank}.err"
        logs.append((out, err))
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
        with open(out, "w") as o, open(err, "w") as e:
            procs.append(hosts.run(rank, argv, timeout=deadline_s + 10, stdout=o, stderr=e,
                                   env=env, cwd=ROOT))
    # Until both have exited, or one has failed (the other would then wait
    # for it until its rpc_timeout), or the deadline has passed.
    end = time.monotonic() + deadline_s
    codes: list = [None, None]
    while time.monotonic() < end:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(codes):
            break
        time.sleep(0.1)
    wall = time.monotonic() - t0
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # timeout(1) leads its group
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
    after = link_bytes(hosts, 0)
    results = []
    for out, _ in logs:
        lines = [ln for ln in out.read_text().splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(lines[-1][len("RESULT "):]) if lines else {})
    res = results[0]
    res["wall_s"] = round(wall, 2)
    res["link_tx_mb"] = round((after[0] - before[0]) / MB, 1)
    res["link_rx_mb"] = round((after[1] - before[1]) / MB, 1)
    res["init_s_w1"] = results[1].get("init_s")
    if codes != [0, 0] or "rows" not in res:
        killed = (f"killed at the {deadline_s:g} s deadline" if wall >= deadline_s
                  else "killed after its peer failed")
        ended = [killed if c is None else f"exit {c}" for c in codes]
        # One line per worker for the JSON: how it ended, and the last line
        # of its traceback if it printed one.
        res["error_short"] = [
            f"worker{r}: {ended[r]}" + "".join(f": {t.strip().splitlines()[-1]}"
                                               for t in [results[r].get("error")] if t)
            for r in (0, 1)]
        res["error"] = "\n".join(
            f"worker{r}: {ended[r]}\n{results[r].get('error', '')}"
            f"{logs[r][1].read_text()[-2000:]}" for r in (0, 1))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=None,
                   help=f"tc rates, or 'unshaped' (default: {' '.join(RATES)})")
    p.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=DEFAULT_BACKENDS,
                   help=f"default: {' '.join(DEFAULT_BACKENDS)}")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every backend this many times per rate, alternating the order; "
                        "ratios are medians of the per-round ratios")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and iterations, 'unshaped' and 10gbit only")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds one worker pair may take (default 150, 60 with --smoke)")
    p.add_argument("--burst-ms", type=float, default=0.25,
                   help="tbf bucket, in ms of traffic at the rate (at least 64 KiB); a transfer "
                        "that fits in it after an idle moment goes faster than the rate")
    p.add_argument("--out", type=Path, help="also write the JSON lines here")
    p.add_argument("--chart", type=Path, help="write a PNG of the ratios, one panel per rate")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    cfg = p.parse_args(argv)
    if cfg.worker is not None:
        worker_main(json.loads(cfg.worker))
        return 0

    from tests.crosshost import netns

    reason = netns.unavailable_reason() or (
        "iproute2's tc is not installed" if shutil.which("tc") is None else None)
    if reason is not None:
        print(f"crosshost_bench: {reason}; it needs root and iproute2 (ip, tc) to make "
              "network namespaces and shape their links", file=sys.stderr)
        return 2
    rates = cfg.rates or (["unshaped", "10gbit"] if cfg.smoke else RATES)
    for rate in rates:
        if rate != "unshaped":
            netns.tc_rate_bytes(rate)  # a bad rate fails now, not after a namespace
    plan = {"rtt": SMOKE_RTT if cfg.smoke else FULL_RTT,
            "pipelined": SMOKE_PIPELINED if cfg.smoke else FULL_PIPELINED}
    deadline = cfg.deadline or (60.0 if cfg.smoke else 150.0)
    out = cfg.out.open("w") if cfg.out else None

    def record(row):
        row = {"bench": "crosshost", **row}
        emit(row)
        if out:
            emit(row, out)

    # A SIGTERM (a test's timeout, a CI job cancelled) unwinds like ^C, so
    # that Hosts kills the workers and deletes the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # runs[(rate, backend)] = one {case: row} per round.
    runs: dict[tuple[str, str], list[dict]] = {}
    failed = 0
    t_start = time.monotonic()
    try:
        with netns.Hosts(2) as hosts, tempfile.TemporaryDirectory(prefix="crosshost") as logdir:
            port = BASE_PORT
            for rate in rates:
                for i in (0, 1):
                    if rate == "unshaped":
                        hosts.unshape(i)
                    else:
                        burst = max(int(netns.tc_rate_bytes(rate) * cfg.burst_ms / 1000),
                                    64 * KB)
                        hosts.shape(i, rate, burst=str(burst))
                for rnd in range(cfg.rounds):
                    order = cfg.backends if rnd % 2 == 0 else cfg.backends[::-1]
                    for backend in order:
                        port += 1  # a fresh rendezvous port per pair
                        res = run_pair(hosts, backend, port, plan, Path(logdir), deadline)
                        head = {"rate": rate, "backend": backend}
                        if cfg.rounds > 1:
                            head["round"] = rnd
                        run_row = {**head, "case": "run", "init_s": res.get("init_s"),
                                   "init_s_w1": res.get("init_s_w1"),
                                   "shutdown_s": res.get("shutdown_s"), "wall_s": res["wall_s"],
                                   "payload_mb_each_way": res.get("payload_mb"),
                                   "link_tx_mb": res["link_tx_mb"],
                                   "link_rx_mb": res["link_rx_mb"]}
                        # Less on the wire than the tensors sent: they went
                        # another way (tensorpipe_default's cma).
                        payload = res.get("payload_mb") or 0
                        if payload and res["link_tx_mb"] < payload / 2:
                            run_row["link_bypassed"] = True
                            print(f"crosshost_bench: {rate} {backend}: {payload} MB of tensors "
                                  f"each way, {res['link_tx_mb']} MB on the link: the times "
                                  "are not the link's", file=sys.stderr)
                        if "security" in res:
                            run_row["transport"] = res.get("transport")
                            run_row["security"] = res["security"]
                        for key in ("lane_segments", "lane_warmup_calls", "lanes_opened",
                                    "lanes_failed", "aes_gcm_vaes"):
                            if key in res:
                                run_row[key] = res[key]
                        if "error" in res:
                            failed += 1
                            run_row["error"] = res["error_short"]
                            print(f"crosshost_bench: {rate} {backend} failed:\n{res['error']}",
                                  file=sys.stderr)
                        record(run_row)
                        rows = {r["case"]: r for r in res.get("rows", [])}
                        for row in rows.values():
                            record({**head, **row})
                        runs.setdefault((rate, backend), []).append(rows)
                for i in (0, 1):
                    hosts.unshape(i)
    except netns.NetnsUnavailable as e:
        print(f"crosshost_bench: {e}", file=sys.stderr)
        return 2
    ratios = ratio_rows(runs, rates)
    for row in ratios:
        record(row)
    elapsed = round(time.monotonic() - t_start, 1)
    print(f"crosshost_bench: {len(rates)} rates x {len(cfg.backends)} backends x "
          f"{cfg.rounds} rounds in {elapsed} s", file=sys.stderr)
    if out:
        out.close()
    if cfg.chart and ratios:
        chart(ratios, rates, cfg.chart)
    return 1 if failed else 0


def ratio_rows(runs: dict, rates: list[str]) -> list[dict]:
    """Per (rate, case) and TORCH_RPC_EXT variant: TensorPipe's median time
    over ours (our calls/s over TensorPipe's for pipelined), per round, and
    their median. Rounds where either side failed are left out."""
    rows = []
    for rate in rates:
        tp_runs = runs.get((rate, "tensorpipe"), [])
        for ext in EXT:
            ext_runs = runs.get((rate, ext), [])
            cases = list(dict.fromkeys(c for rows in ext_runs for c in rows))
            for case in cases:
                per_round = []
                for e, t in zip(ext_runs, tp_runs):
                    if case in e and case in t:
                        if "calls_s" in e[case]:
                            per_round.append(e[case]["calls_s"] / t[case]["calls_s"])
                        else:
                            per_round.append(t[case]["median_ms"] / e[case]["median_ms"])
                if not per_round:
                    continue
                row = {"rate": rate, "case": case, "ratio": f"{ext}_vs_tensorpipe",
                       "value": round(statistics.median(per_round), 3)}
                if len(per_round) > 1:
                    row["per_round"] = [round(x, 3) for x in per_round]
                rows.append(row)
    return rows


def chart(ratios: list[dict], rates: list[str], path: Path) -> None:
    """One panel per rate: per case, a bar per TORCH_RPC_EXT variant with
    its ratio to TensorPipe (above 1: ours faster), on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in rates if any(x["rate"] == r for x in ratios)]
    cases = list(dict.fromkeys(x["case"] for x in ratios))
    variants = list(dict.fromkeys(x["ratio"] for x in ratios))
    colors = {"ext_tls_vs_tensorpipe": "tab:blue", "ext_clear_vs_tensorpipe": "tab:orange",
              "ext_tls_lanes_vs_tensorpipe": "lightsteelblue",
              "ext_clear_lanes_vs_tensorpipe": "navajowhite",
              "ext_tls_libcrypto_vs_tensorpipe": "tab:gray"}
    fig, axes = plt.subplots(1, len(rates), figsize=(3.6 * len(rates) + 1, 0.45 * len(cases) + 2),
                             sharex=True, sharey=True, squeeze=False)
    height = 0.8 / max(1, len(variants))
    for ax, rate in zip(axes[0], rates):
        for k, variant in enumerate(variants):
            got = {x["case"]: x["value"] for x in ratios
                   if x["rate"] == rate and x["ratio"] == variant}
            ys = [i + (k - (len(variants) - 1) / 2) * height for i in range(len(cases))]
            # Bars grow from 1: to the right where ours is faster.
            ax.barh(ys, [got.get(c, float("nan")) - 1 for c in cases], left=1, height=height,
                    color=colors.get(variant), label=variant.replace("_vs_tensorpipe", ""))
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_xscale("log")
        ax.set_title(rate)
        ax.set_xlabel("TensorPipe time / ours (>1: ours faster)", fontsize=8)
    axes[0][0].set_yticks(range(len(cases)), cases)
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle("TORCH_RPC_EXT vs TensorPipe (uv) across two namespace hosts, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
