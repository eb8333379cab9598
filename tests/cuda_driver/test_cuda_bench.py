# SPDX-License-Identifier: BSD-3-Clause
"""benchmarks/cuda_bench.py runs end to end: on the fake driver in CI
(--fake: ours only, small sizes; it proves the script and the CUDA path it
drives, not a figure), in --smoke form on a GPU machine (both backends)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda_driver.conftest import REAL_DRIVER

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def test_cuda_bench_runs_every_case(driver_env, tmp_path):
    out = tmp_path / "cuda.jsonl"
    mode = "--smoke" if REAL_DRIVER else "--fake"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cuda_bench.py"), mode, "--out", str(out)],
        cwd=tmp_path, env={**os.environ, **driver_env}, check=True, timeout=540)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    timed = {(r["backend"], r["case"]) for r in rows if "median_us" in r}
    cases = {"identity_4KB", "identity_64KB", "identity_4MB", "many_256x16KB",
             "many_1000x1KB", "strided_128KB", "contiguous_128KB"}
    assert {("ext", c) for c in cases} <= timed
    assert ("ext_staged", "identity_4MB") in timed
    assert {("ext_zero_copy", c) for c in cases - {"contiguous_128KB"}} <= timed
    # Landing in torch's memory: one copy per received tensor, one launch
    # per message, both ends; none under cuda_zero_copy.
    copies = {(r["backend"], r["case"]): r["copies_per_call"] for r in rows
              if "copies_per_call" in r}
    assert copies[("ext", "identity_4MB")]["landed"] == 2
    assert copies[("ext", "identity_4MB")]["landing_launches"] == 2
    assert copies[("ext", "many_256x16KB")]["landed"] == 512
    assert copies[("ext", "many_256x16KB")]["landing_launches"] == 2
    assert copies[("ext_zero_copy", "identity_4MB")]["landed"] == 0
    assert all(r["median_us"] > 0 for r in rows if "median_us" in r)
    if REAL_DRIVER:
        assert {("tensorpipe", c) for c in cases} <= timed
        assert {r["case"] for r in rows if r.get("ratio") == "time_ext_over_tp"} >= cases
