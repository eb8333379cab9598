# SPDX-License-Identifier: BSD-3-Clause
"""Execute the tutorial notebooks with a Jupyter kernel (nbclient).

    python tools/notebooks.py                     # run every notebook, store outputs
    python tools/notebooks.py tutorials/03_*.ipynb
    python tools/notebooks.py --check             # run, compare with what is stored

Storing writes each notebook back with the outputs its code produced (less
stderr: worker logs and profiler chatter, which no check reads) and the line
of its first cell that begins with ``*Run`` set to the measured run time and
this machine's hardware. ``--check`` (what CI does, through tests/tutorials)
writes nothing: it fails on any cell error, and on stored outputs that this
code no longer produces. Outputs are compared by shape: per cell the same
outputs in the same order, the same MIME types (a figure is compared as a
figure, not by its pixels), and the same stdout and text with every number
masked and runs of spaces collapsed (timings and losses vary from run to run;
wording, structure and the set of printed lines do not). A cell tagged
``exact`` is compared to the letter, one tagged ``varies`` by output types
only (its text depends on the machine, e.g. whether it has a GPU).

Notebooks run with TMPDIR set to a directory that is removed afterwards, so
their scratch files go with it. Worker processes must not print: ipykernel
forwards what they write to its file descriptors into whichever cell runs at
that moment; they report to the notebook (a queue), which prints.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
RUN_LINE = re.compile(r"^\*Run[^\n]*\*$", re.M)
# Grouped thousands (1,945) are one number, as 945 is.
NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+(\.\d*)?|\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def notebooks() -> list[Path]:
    return sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))


def hardware() -> str:
    import torch

    cores = len(os.sched_getaffinity(0))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cores} CPU cores ({platform.machine()}), {gpu}, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def execute(path: Path, timeout: int = 600) -> tuple[nbformat.NotebookNode, float]:
    """Run every cell of ``path`` in a fresh kernel started in tutorials/."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    saved = os.environ.get("TMPDIR")
    with tempfile.TemporaryDirectory(prefix="notebook-") as scratch:
        os.environ["TMPDIR"] = scratch  # the kernel and its workers inherit it
        try:
            start = time.perf_counter()
            client.execute()
            return nb, time.perf_counter() - start
        finally:
            if saved is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = saved


def _streams(outputs: list) -> list:
    """Outputs with consecutive chunks of one stream joined (how a kernel
    splits a stream into messages depends on timing) and stderr dropped."""
    merged: list = []
    for out in outputs:
        if out["output_type"] == "stream":
            if out["name"] == "stderr":
                continue
            if merged and merged[-1]["output_type"] == "stream" and merged[-1]["name"] == out["name"]:
                merged[-1] = dict(merged[-1], text=merged[-1]["text"] + out["text"])
                continue
        merged.append(out)
    return merged


def _masked(text: str) -> str:
    """Numbers to '#', runs of spaces to one (numbers are padded to a width)."""
    return re.sub(r"[ \t]+", " ", NUMBER.sub("#", text))


def _shape(out: dict, text_of) -> tuple:
    kind = out["output_type"]
    if kind == "stream":
        return (kind, out["name"], text_of(out["text"]))
    if kind in ("display_data", "execute_result"):
        data = out.get("data", {})
        text = data.get("text/plain", "")
        # A figure's repr names its size and address; compare its MIME types only.
        if "image/png" in data:
            text = ""
        return (kind, tuple(sorted(data)), text_of(text))
    return (kind, out.get("ename", ""))


def compare(stored: nbformat.NotebookNode, produced: nbformat.NotebookNode) -> list[str]:
    """Differences between the outputs stored in a notebook and those its code
    produced; empty when they match (see the module's docstring)."""
    problems = []
    for index, (a, b) in enumerate(zip(stored.cells, produced.cells)):
        if a.cell_type != "code":
            continue
        tags = a.get("metadata", {}).get("tags", [])
        text_of = (str if "exact" in tags else (lambda t: "") if "varies" in tags else _masked)
        want = [_shape(o, text_of) for o in _streams(a.get("outputs", []))]
        got = [_shape(o, text_of) for o in _streams(b.get("outputs", []))]
        if want != got:
            problems.append(f"cell {index}: stored {want!r}\n    produced {got!r}")
        if any(o["output_type"] == "error" for o in a.get("outputs", [])):
            problems.append(f"cell {index}: the stored outputs hold an error")
    if not any(c.cell_type == "code" and c.get("outputs") for c in stored.cells):
        problems.append("no stored outputs")
    if not RUN_LINE.search(stored.cells[0].source):
        problems.append("the first cell has no '*Run ...*' line (run time and hardware)")
    return problems


def store(path: Path) -> float:
    nb, seconds = execute(path)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs
                            if not (o["output_type"] == "stream" and o["name"] == "stderr")]
            cell.metadata.pop("execution", None)  # timestamps: noise in every diff
    line = f"*Run in {seconds:.0f} s on {hardware()}; outputs stored from that run.*"
    first = nb.cells[0]
    if RUN_LINE.search(first.source):
        first.source = RUN_LINE.sub(line, first.source, count=1)
    else:
        first.source = first.source.rstrip("\n") + "\n\n" + line
    nbformat.write(nb, path)
    return seconds


def check(path: Path) -> list[str]:
    stored = nbformat.read(path, as_version=4)
    try:
        produced, _ = execute(path)
    except CellExecutionError as exc:
        return [f"a cell failed:\n{exc}"]
    return compare(stored, produced)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, store nothing")
    parser.add_argument("paths", nargs="*", type=Path)
    args = parser.parse_args()
    failed = 0
    for path in args.paths or notebooks():
        if args.check:
            problems = check(path)
            failed += bool(problems)
            print(f"{path.name}: {'ok' if not problems else 'DIFFERS'}", flush=True)
            for p in problems:
                print("  " + p)
        else:
            print(f"{path.name}: stored, {store(path):.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
