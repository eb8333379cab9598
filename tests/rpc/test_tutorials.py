# SPDX-License-Identifier: BSD-3-Clause
"""Every tutorial notebook's code cells run, in order, without error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_notebook_runs(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n\n".join(
        "".join(c["source"]) for c in cells if c["cell_type"] == "code"
    )
    assert code.strip(), f"{notebook.name} has no code"
    root = str(TUTORIALS.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=TUTORIALS, capture_output=True,
        text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_there_are_tutorials():
    assert NOTEBOOKS
