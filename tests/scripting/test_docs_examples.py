# SPDX-License-Identifier: BSD-3-Clause
"""The runnable examples of docs/scripting.md, docs/profiling.md and the
migration example of docs/guide.md run as written (on a free port) and print
what they promise."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rpc.world import free_port

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def run_example(doc: str, tmp_path: Path) -> str:
    text = (ROOT / "docs" / doc).read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code, n = re.subn(r'MASTER_PORT="\d+"', f'MASTER_PORT="{free_port()}"', code)
    assert n == 1, "the example names its port once"
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHINDUCTOR_COMPILE_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_scripting_example(tmp_path):
    out = run_example("scripting.md", tmp_path)
    assert "[11., 11., 11., 11.]" in out  # eager: x @ 0.5
    assert "[12., 12., 12., 12.]" in out  # scripted: + 1
    assert "[5., 6., 7., 8.]" in out  # compiled: x + 1


def test_profiling_example(tmp_path):
    out = run_example("profiling.md", tmp_path)
    assert "torch_rpc_ext::wait" in out and "remote_block" in out and "aten::mm" in out
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"torch_rpc_ext::encode", "torch_rpc_ext::wait", "remote_block"} <= names


def test_guide_migration_example(tmp_path):
    out = run_example("guide.md", tmp_path).splitlines()
    assert out == ["tensor([2., 2.])", "1", "shm"], out
