# SPDX-License-Identifier: BSD-3-Clause
"""CI's short soak (benchmarks/soak.py): 4 workers, 256 calls in flight each,
no response lost, duplicated or crossed; graceful shutdown issued with 1,000
calls in flight completes every one of them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.build_flags import SANITIZER

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def test_short_soak():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"),
         "--workers", "4", "--calls", "40000", "--window", "256", "--at-shutdown", "250"],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["calls"] == 40000
    assert r["ok"] == r["calls"] and r["wrong"] == 0 and r["errors"] == 0, r
    assert r["unfinished"] == 0 and r["late_responses"] == 0, r
    assert r["in_flight_at_shutdown"] == 1000
    assert r["drained_at_shutdown"] == 1000, r
    # The long run holds growth under 10% (docs/reliability.md); a short run
    # samples its "warm" point early, so it gets more slack (not measurable
    # under a sanitizer: tests/build_flags.py).
    assert SANITIZER or r["max_rss_growth"] < 0.25, r
    assert proc.returncode == 0
