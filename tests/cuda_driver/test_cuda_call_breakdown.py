# SPDX-License-Identifier: BSD-3-Clause
"""benchmarks/cuda_call_breakdown.py end to end: the call trace's segments
of a CUDA call, on the fake driver in CI (--fake) and on a GPU machine
(tools/gpu_check.sh's pytest step). It proves the tool, not a figure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda_driver.conftest import REAL_DRIVER

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)
SEGMENTS = ["python_to_agent", "encode", "write", "to_callee", "callee_dispatch",
            "callee_run", "respond", "to_caller", "settle", "complete", "to_python"]


def test_a_cuda_call_splits_into_its_hand_offs(tmp_path, driver_env):
    args = [sys.executable, str(ROOT / "benchmarks" / "cuda_call_breakdown.py"),
            "--calls", "40", "--warmup", "3"]
    if not REAL_DRIVER:
        args.append("--fake")
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, **driver_env})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    totals = {r["case"]: r for r in rows if r.get("segment") == "total"}
    assert set(totals) == {"cpu_4KB", "cuda_4KB", "self_4KB", "many_1000x1KB"}, rows
    for case, total in totals.items():
        # Nearly every call came back with all ten stamps (one at a window's
        # edge may not: small_call_breakdown.py's join drops it), and its
        # segments add up to the whole. Their medians do not: on a loaded
        # host each call's stall falls in another segment, which leaves each
        # segment's median where it was and moves the whole's, so the sum
        # of medians is held from above only (as test_benchmark_smoke.py
        # holds the CPU call's not at all).
        calls = 8 if case == "many_1000x1KB" else 40
        assert calls - 2 <= total["n"] <= calls, total
        parts = {r["segment"]: r["median_us"] for r in rows
                 if r.get("case") == case and r.get("segment") in SEGMENTS}
        assert set(parts) == set(SEGMENTS), parts
        assert 0 < sum(parts.values()) < 1.5 * total["median_us"], (case, parts, total)
        # callee_run in two (kServeReturned): the function's run, then the
        # rest until the response starts; together about the whole of it.
        split = {r["part"]: r for r in rows if r.get("case") == case and "part" in r}
        assert set(split) == {"callee_call", "callee_result"}, split
        assert all(r["of"] == "callee_run" and r["n"] >= calls - 2 for r in split.values()), split
        run = parts["callee_run"]
        assert split["callee_call"]["median_us"] > 0 and split["callee_result"]["median_us"] > 0
        assert sum(r["median_us"] for r in split.values()) < 1.5 * run, (split, run)
    profile = next(r["caller_profile"] for r in rows if "caller_profile" in r)
    assert any("rpc_sync" in p["function"] for p in profile), profile
