# SPDX-License-Identifier: BSD-3-Clause
"""tests/cpu_use.py: the summary of the CPU each test used, which
tools/test.sh asks of every stage (a clean run is bound by CPU)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# One test burns CPU in a forked child it waits for, one in this process,
# one sleeps: the summary ranks them by CPU, children included.
SAMPLE = textwrap.dedent("""
    import os, time

    def burn(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    def test_sleeps():
        time.sleep(0.6)

    def test_burns_in_a_child():
        pid = os.fork()
        if pid == 0:
            burn(0.6)
            os._exit(0)
        os.waitpid(pid, 0)

    def test_burns_here():
        burn(0.3)
""")


def run_sample(tmp_path, top):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if top is None:
        env.pop("TORCH_RPC_EXT_CPU_TOP", None)
    else:
        env["TORCH_RPC_EXT_CPU_TOP"] = top
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.cpu_use", "-p", "no:cacheprovider",
         "-q", str(tmp_path / "test_sample.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_the_summary_ranks_tests_and_files_by_the_cpu_they_used(tmp_path):
    result = run_sample(tmp_path, "2")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "CPU:" in line and "of tests" in line)
    assert lines[start + 1] == "the 2 tests that used the most:"
    ranked = lines[start + 2:start + 4]
    assert ranked[0].endswith("test_sample.py::test_burns_in_a_child"), ranked
    assert ranked[1].endswith("test_sample.py::test_burns_here"), ranked
    assert float(ranked[0].split()[0]) >= 0.5
    assert lines[start + 4] == "the 2 files that used the most:"
    assert lines[start + 5].endswith("test_sample.py (3 tests)")
    assert float(lines[start + 5].split()[0]) >= 0.8
    # The sleeper used next to none: it is not in the top two.
    assert not any("test_sleeps" in line for line in lines[start:])


def test_the_suite_loads_it(request):
    assert request.config.pluginmanager.has_plugin("tests.cpu_use")


def test_no_summary_unless_asked_and_a_bad_count_is_named(tmp_path):
    quiet = run_sample(tmp_path, None)
    assert quiet.returncode == 0 and "CPU:" not in quiet.stdout
    bad = run_sample(tmp_path, "many")
    assert bad.returncode != 0
    assert "TORCH_RPC_EXT_CPU_TOP must be a whole number, not 'many'" in bad.stdout + bad.stderr
