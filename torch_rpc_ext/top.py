# SPDX-License-Identifier: BSD-3-Clause
"""A live view of a running group, as ``htop`` is of processes.

    python -m torch_rpc_ext.top HOST:PORT [HOST:PORT ...]

Each HOST:PORT is a worker's metrics endpoint (torch_rpc_ext.metrics:
``serve(port)`` or ``TORCH_RPC_EXT_METRICS_PORT``). Every second it reads
them all and shows, per worker and per peer: calls made and served per
second, the p99 of calls made over the last interval, errors and timeouts,
bytes per second each way, calls in flight and how long the oldest of them
has waited (what a worker of a hung job waits on), and per worker the
requests it is serving and how long it has held the oldest (what it holds
for others: its ``/serving`` lists them); under a worker that is not
ready (its ``/readyz``: no agent, shutting down, declared dead, a loop
that a handler blocks), why. ``--once`` prints one screen (after one
interval) and exits; Ctrl-C quits.
"""

from __future__ import annotations

import argparse
import http.client
import math
import sys
import time
import urllib.request
from dataclasses import dataclass, field

_CLEAR = "\x1b[H\x1b[2J"


@dataclass
class Sample:
    """One scrape of one endpoint."""

    at: float
    worker: str = "?"
    # (peer, series) -> value; series: made, served, sent, received, errors,
    # timeouts.
    counters: dict = field(default_factory=dict)
    # peer -> {upper bound: cumulative count} of calls made (every kind)
    buckets: dict = field(default_factory=dict)
    in_flight: float = 0.0
    # peer -> seconds its oldest call in flight has waited (0: none).
    oldest: dict = field(default_factory=dict)
    # Requests the worker is serving, and seconds since the oldest was read.
    serving: float = 0.0
    held: float = 0.0
    error: str = ""
    # Why the worker is not ready (its /readyz), "" if it is or cannot say.
    not_ready: str = ""


# How long top's readiness probe lets a worker's loops take (its /readyz).
READY_TIMEOUT = 0.5


def readiness(endpoint: str, timeout: float = 2.0) -> str:
    """Why the worker at ``endpoint`` is not ready ("" if it is, or if its
    endpoint has no /readyz: an older torch_rpc_ext answers metrics there)."""
    import json
    import urllib.error

    url = f"http://{endpoint}/readyz?timeout={READY_TIMEOUT}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        if e.code != 503:
            return ""
        body = e.read()
    except (OSError, http.client.HTTPException):
        return ""  # (its metrics' scrape says so, if it is gone)
    try:
        state = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(state, dict) or state.get("ready", True):
        return ""
    return str(state.get("why") or "not ready")


def scrape(endpoint: str, timeout: float = 2.0) -> Sample:
    from prometheus_client.parser import text_string_to_metric_families

    sample = Sample(at=time.monotonic())
    try:
        text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout).read()
        # (Parsed whole here: a page that is not metrics fails as it is read.)
        families = list(text_string_to_metric_families(text.decode()))
    except (OSError, http.client.HTTPException, ValueError) as e:
        # A worker gone mid-answer, a port that is not a metrics endpoint:
        # that worker's row says so; the others go on.
        sample.error = str(getattr(e, "reason", e)) or type(e).__name__
        return sample
    names = {"calls_total": "direction", "bytes_total": "direction",
             "errors_total": None, "timeouts_total": None}
    for fam in families:
        for s in fam.samples:
            worker = s.labels.get("worker")
            if worker:
                sample.worker = worker
            name = s.name.removeprefix("torch_rpc_ext_")
            peer = s.labels.get("peer")
            if name in names and peer:
                key = names[name]
                series = s.labels[key] if key else name.removesuffix("_total")
                sample.counters[(peer, series)] = s.value
            elif name == "call_duration_seconds_bucket" and peer:
                le = float(s.labels["le"])
                per = sample.buckets.setdefault(peer, {})
                per[le] = per.get(le, 0.0) + s.value
            elif name == "calls_in_flight":
                sample.in_flight += s.value  # per peer: the worker's sum
            elif name == "oldest_call_age_seconds" and peer:
                sample.oldest[peer] = s.value
            elif name == "serving":
                sample.serving = s.value
            elif name == "oldest_request_age_seconds":
                sample.held = s.value
    sample.not_ready = readiness(endpoint, timeout)
    return sample


def quantile(q: float, before: dict, after: dict) -> float | None:
    """The q-quantile of what fell in cumulative buckets between two
    scrapes (as Prometheus's histogram_quantile: linear in a bucket)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(bound):
                return lower
            width = count - below
            return lower + (bound - lower) * ((rank - below) / width if width else 1.0)
        lower, below = bound, count
    return None


def _rate(after: Sample, before: Sample | None, peer: str, series: str) -> float:
    if before is None or before.error:
        return 0.0
    dt = max(after.at - before.at, 1e-6)
    return max(0.0, after.counters.get((peer, series), 0.0)
               - before.counters.get((peer, series), 0.0)) / dt


def _seconds(value: float | None) -> str:
    if value is None or value <= 0:
        return "-"
    return f"{value * 1e3:.2f}ms" if value < 1 else f"{value:.2f}s"


def _bytes(rate: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if rate < 1024 or unit == "GB":
            return f"{rate:.0f}{unit}/s" if unit == "B" else f"{rate:.1f}{unit}/s"
        rate /= 1024
    return ""


def render(endpoints: list[str], now: dict, last: dict) -> str:
    lines = [time.strftime("torch_rpc_ext top  %H:%M:%S") +
             f"  {len(endpoints)} worker(s)", ""]
    header = (f"{'worker':<14}{'peer':<14}{'made/s':>9}{'served/s':>10}{'p99':>11}"
              f"{'errors':>8}{'timeouts':>9}{'sent':>11}{'received':>11}{'in flight':>10}"
              f"{'oldest':>10}{'serving':>9}{'held':>10}")
    lines.append(header)
    lines.append("-" * len(header))
    for endpoint in endpoints:
        after, before = now[endpoint], last.get(endpoint)
        if after.error:
            lines.append(f"{endpoint:<28}unreachable: {after.error}")
            continue
        peers = sorted({p for p, _ in after.counters})
        made = sum(_rate(after, before, p, "made") for p in peers)
        served = sum(_rate(after, before, p, "served") for p in peers)
        sent = sum(_rate(after, before, p, "sent") for p in peers)
        received = sum(_rate(after, before, p, "received") for p in peers)
        errors = sum(after.counters.get((p, "errors"), 0) for p in peers)
        timeouts = sum(after.counters.get((p, "timeouts"), 0) for p in peers)
        total_after, total_before = {}, {}
        for p in peers:
            for b, c in after.buckets.get(p, {}).items():
                total_after[b] = total_after.get(b, 0.0) + c
            for b, c in (before.buckets.get(p, {}) if before else {}).items():
                total_before[b] = total_before.get(b, 0.0) + c
        p99 = quantile(0.99, total_before, total_after) if before else None
        lines.append(f"{after.worker:<14}{'(all)':<14}{made:>9.0f}{served:>10.0f}"
                     f"{_seconds(p99):>11}{errors:>8.0f}{timeouts:>9.0f}{_bytes(sent):>11}"
                     f"{_bytes(received):>11}{after.in_flight:>10.0f}"
                     f"{_seconds(max(after.oldest.values(), default=0.0)):>10}"
                     f"{after.serving:>9.0f}{_seconds(after.held):>10}")
        if after.not_ready:
            lines.append(f"{'':<14}not ready: {after.not_ready}")
        for p in peers:
            if not any(after.counters.get((p, k)) for k in
                       ("made", "served", "sent", "received", "errors", "timeouts")):
                continue  # never talked to (itself, among others)
            p99 = (quantile(0.99, before.buckets.get(p, {}), after.buckets.get(p, {}))
                   if before else None)
            lines.append(
                f"{'':<14}{p:<14}{_rate(after, before, p, 'made'):>9.0f}"
                f"{_rate(after, before, p, 'served'):>10.0f}{_seconds(p99):>11}"
                f"{after.counters.get((p, 'errors'), 0):>8.0f}"
                f"{after.counters.get((p, 'timeouts'), 0):>9.0f}"
                f"{_bytes(_rate(after, before, p, 'sent')):>11}"
                f"{_bytes(_rate(after, before, p, 'received')):>11}{'':>10}"
                f"{_seconds(after.oldest.get(p)):>10}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torch_rpc_ext.top", description=__doc__.splitlines()[0])
    parser.add_argument("endpoints", nargs="+", metavar="HOST:PORT",
                        help="the workers' metrics endpoints")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between screens")
    parser.add_argument("--once", action="store_true", help="print one screen and exit")
    args = parser.parse_args(argv)
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        print("torch_rpc_ext.top needs prometheus_client: pip install 'torch_rpc_ext[metrics]'",
              file=sys.stderr)
        return 2
    last = {e: scrape(e) for e in args.endpoints}
    try:
        while True:
            time.sleep(args.interval)
            now = {e: scrape(e) for e in args.endpoints}
            screen = render(args.endpoints, now, last)
            sys.stdout.write(screen if args.once else _CLEAR + screen)
            sys.stdout.flush()
            last = now
            if args.once:
                return 0
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
