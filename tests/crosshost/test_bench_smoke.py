# SPDX-License-Identifier: BSD-3-Clause
"""benchmarks/crosshost_bench.py --smoke runs to the end: both hosts' worker
pairs start and finish for every backend at both of its rates, and it prints
the ratio lines of TORCH_RPC_EXT with TLS and in the clear against
TensorPipe. The figures themselves are not checked (a shared machine makes
them noise). Needs root and iproute2, like the other tests here; skips
otherwise."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.crosshost import netns

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 240  # ~20 s on an idle two-core machine


@pytest.mark.timeout(DEADLINE_S + 60)
def test_crosshost_bench_smoke(tmp_path):
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    chart = tmp_path / "ratios.png"
    p = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "crosshost_bench.py"),
                          "--smoke", "--chart", str(chart)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = p.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the benchmark then kills its workers and deletes
        # its namespaces.
        p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        pytest.fail(f"crosshost_bench --smoke took over {DEADLINE_S} s:\n{err[-4000:]}")
    if p.returncode == 2 and "cannot build network namespaces" in err:
        pytest.skip(err.strip())  # a kernel or container that forbids them
    assert p.returncode == 0, err[-4000:]
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    runs = [r for r in rows if r.get("case") == "run"]
    assert {(r["rate"], r["backend"]) for r in runs} == {
        (rate, b) for rate in ("unshaped", "10gbit")
        for b in ("ext_tls", "ext_clear", "tensorpipe")}
    for r in runs:
        assert "error" not in r, r
        # Every backend's tensors crossed the link between the hosts.
        assert not r.get("link_bypassed"), r
        if r["backend"] == "ext_tls":
            assert r["security"].startswith("TLSv1.3"), r
            # Its defaults stripe 1 MiB tensors over lanes when encrypted
            # (the benchmark's warm-up waits for them to be up).
            assert r["lane_segments"] >= 1 and r["lanes_failed"] == 0, json.dumps(r)
        elif r["backend"] == "ext_clear":
            assert r["security"] == "none (encryption off)", r
            assert r["lane_segments"] == 0, r
    ratios = {(r["rate"], r["case"], r["ratio"]): r["value"] for r in rows if "ratio" in r}
    for rate in ("unshaped", "10gbit"):
        for variant in ("ext_tls_vs_tensorpipe", "ext_clear_vs_tensorpipe"):
            for case in ("first_call", "rtt_1KB", "rtt_1MB", "pipelined_64KB"):
                assert ratios.get((rate, case, variant), 0) > 0, (rate, case, variant, ratios)
    assert chart.stat().st_size > 0
    assert netns.leftovers(f"{netns.NAME_PREFIX}{p.pid}") == []
