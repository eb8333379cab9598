# SPDX-License-Identifier: BSD-3-Clause
"""The benchmark suite runs end to end in smoke mode, so it cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_benchmark_smoke_emits_both_backends_and_ratios(tmp_path):
    out = tmp_path / "bench.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rpc_bench.py"), "--smoke",
         "--cases", "small", "pipelined", "tensor", "--grpc",
         "--chart", str(tmp_path / "chart.png"), "--out", str(out)],
        capture_output=True, text=True, timeout=540, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    measured = {(r["case"], r["backend"]) for r in rows if "backend" in r}
    for case in ["small_builtin", "small_udf", "small_script", "pipelined_async",
                 "identity_1MB_x1", "heavy_script_1MB_x10"]:
        assert (case, "ext") in measured and (case, "tensorpipe") in measured, case
    ratios = {r["case"]: r["value"] for r in rows if "ratio" in r}
    assert set(ratios) >= {"small_builtin", "pipelined_async", "identity_1MB_x1"}
    assert all(v > 0 for v in ratios.values())
    assert all(r["peak_rss_mb"] for r in rows if "backend" in r)
    assert ("identity_1MB_x1", "grpc") in measured
    speedups = {r["case"] for r in rows if r.get("ratio") == "speedup_ext_over_grpc"}
    assert "identity_1MB_x1" in speedups
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
