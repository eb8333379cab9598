# SPDX-License-Identifier: BSD-3-Clause
"""Which tests take the CPU: a pytest plugin (tests/conftest.py loads it;
`-p tests.cpu_use` outside this suite). Not under pytest-xdist, whose
controller runs no test.

A clean run of the suite on 2 cores is bound by CPU, not by waits
(docs/development.md, "Where a clean run's time goes"), so pytest's
--durations, which lists wall time, says little about what to cut.
With TORCH_RPC_EXT_CPU_TOP=N set (tools/test.sh sets it), the summary
lists the N tests and the N test files that used the most CPU: the pytest
process's threads and every process it waited for (forked workers joined,
subprocesses run to their end, and what those waited for), as
getrusage(2) counts them. A process nobody waited for (a daemon reaped by
init) is not counted."""

import os
import resource
import time

import pytest

_ENV = "TORCH_RPC_EXT_CPU_TOP"
_used: list[tuple[float, float, str]] = []  # (CPU s, wall s, node id)


def _cpu_seconds() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


_top = 0


def pytest_configure(config):
    global _top
    try:
        _top = max(0, int(os.environ.get(_ENV, "0")))
    except ValueError:
        raise pytest.UsageError(f"{_ENV} must be a whole number, not {os.environ[_ENV]!r}") from None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _top:
        yield
        return
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    _used.append((_cpu_seconds() - cpu, time.monotonic() - wall, item.nodeid))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    top = _top
    if not top or not _used:
        return
    write = terminalreporter.write_line
    cpu_total = sum(cpu for cpu, _, _ in _used)
    wall_total = sum(wall for _, wall, _ in _used)
    terminalreporter.write_sep(
        "=", f"CPU: {cpu_total:.0f} s over {wall_total:.0f} s of tests "
        "(this process and those it waited for)")
    write(f"the {top} tests that used the most:")
    for cpu, wall, nodeid in sorted(_used, reverse=True)[:top]:
        write(f"{cpu:8.1f} s CPU {wall:7.1f} s wall  {nodeid}")
    files: dict[str, list[float]] = {}
    for cpu, wall, nodeid in _used:
        entry = files.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0])
        entry[0] += cpu
        entry[1] += wall
        entry[2] += 1
    write(f"the {top} files that used the most:")
    ranked = sorted(files.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    for path, (cpu, wall, count) in ranked:
        write(f"{cpu:8.1f} s CPU {wall:7.1f} s wall  {path} ({count} tests)")
