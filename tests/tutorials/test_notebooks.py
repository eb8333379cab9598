# SPDX-License-Identifier: BSD-3-Clause
"""Every tutorial notebook runs, top to bottom, in a Jupyter kernel (nbclient),
and its stored outputs are the ones its code produces (tools/notebooks.py
says how they are compared). Refresh them with `python tools/notebooks.py`."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("notebooks", ROOT / "tools" / "notebooks.py")
notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(notebooks)

NOTEBOOKS = notebooks.notebooks()


def test_the_curriculum_is_there():
    names = [n.name.split("_", 1)[0] for n in NOTEBOOKS]
    assert names == ["01", "02", "03", "04", "05", "06", "07", "08", "09"], names


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_notebook_runs_and_its_stored_outputs_are_its_own(path):
    problems = notebooks.check(path)
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_compare_sees_a_changed_output():
    """The comparison is not vacuous: a stored line the code no longer prints,
    a missing figure, or an error among the stored outputs is reported."""
    import copy

    stored = notebooks.nbformat.read(NOTEBOOKS[0], as_version=4)
    assert notebooks.compare(stored, stored) == []
    index, cell = next((i, c) for i, c in enumerate(stored.cells)
                       if c.cell_type == "code" and any(o["output_type"] == "stream" for o in c.outputs))
    produced = copy.deepcopy(stored)
    stream = next(o for o in produced.cells[index].outputs if o["output_type"] == "stream")
    stream["text"] = "a line this code does not print\n" + stream["text"]
    assert any(f"cell {index}" in p for p in notebooks.compare(stored, produced))
    produced = copy.deepcopy(stored)
    figure = next(c for c in produced.cells if c.cell_type == "code"
                  and any("image/png" in o.get("data", {}) for o in c.outputs))
    figure.outputs = [o for o in figure.outputs if "image/png" not in o.get("data", {})]
    assert notebooks.compare(stored, produced)
    errored = copy.deepcopy(stored)
    errored.cells[index].outputs.append(
        notebooks.nbformat.v4.new_output("error", ename="ValueError", evalue="x", traceback=[]))
    assert any("error" in p for p in notebooks.compare(errored, errored))
    # Numbers may differ (timings, losses); words and lines may not.
    produced = copy.deepcopy(stored)
    stream = next(o for o in produced.cells[index].outputs if o["output_type"] == "stream")
    stream["text"] = notebooks.NUMBER.sub("7", stream["text"])
    assert notebooks.compare(stored, produced) == []
    # ...unless the cell is tagged exact; a cell tagged varies keeps only its kinds.
    stored.cells[index].metadata["tags"] = ["exact"]
    assert any(f"cell {index}" in p for p in notebooks.compare(stored, produced))
    stored.cells[index].metadata["tags"] = ["varies"]
    stream["text"] = "other words entirely\n"
    assert notebooks.compare(stored, produced) == []
