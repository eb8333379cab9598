# SPDX-License-Identifier: BSD-3-Clause
"""Every benchmark run a doc cites is committed (docs/development.md,
"Benchmark results"): a figure whose raw lines were not kept says so
instead of naming a file that is not there."""

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"benchmarks/results/[A-Za-z0-9._{},-]+")


def _expand(path: str) -> list[str]:
    # One {a,b} group, as the docs write a pair of runs.
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [path[: m.start()] + part + path[m.end():] for part in m.group(1).split(",")]


def _cited() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    sources = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
               *(ROOT / "tutorials").glob("*.ipynb")]
    for src in sources:
        for raw in CITED.findall(src.read_text(encoding="utf-8")):
            raw = raw.rstrip(".,")
            if not raw.endswith((".jsonl", ".png", ".json", ".txt")):
                continue  # (the folder itself, or a pattern the text explains)
            for path in _expand(raw):
                out.setdefault(path, []).append(str(src.relative_to(ROOT)))
    return out


def test_every_cited_benchmark_result_is_committed():
    cited = _cited()
    assert cited, "no doc cites a benchmark result: the pattern no longer matches"
    if shutil.which("git") and (ROOT / ".git").exists():
        tracked = set(subprocess.run(
            ["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True,
            text=True, check=True).stdout.split())
    else:  # (a tree without git: what is on disk)
        tracked = {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks/results").iterdir()}
    missing = {p: srcs for p, srcs in cited.items() if p not in tracked}
    assert not missing, (
        "cited but not committed (commit it with a `!` line in .gitignore, or say "
        f"the raw lines were not kept): {missing}")
