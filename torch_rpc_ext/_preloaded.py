# SPDX-License-Identifier: BSD-3-Clause
"""Processes started as `spawn` starts them, without a fresh import of torch
each: children of a fork server that imported torch, numpy and
torch_rpc_ext once. The tests' workers that load a CUDA driver
(tests/cuda_driver, tests/cuda_fake) and the benchmarks' worlds
(benchmarks/_harness.py) start this way; not part of the API.

A spawned worker spends about 3 s of CPU importing torch (6 s beside a
second lane of tests); the fake-CUDA stage started 207 of them, most of its
CPU time, and CI's benchmark runs about 50 more. The fork server
(multiprocessing's "forkserver") is a process of its own that imported
those modules and nothing more: it loaded no CUDA
driver and ran no torch compute, so it has no threads a fork could leave
half-copied (tests/cuda_driver/worker.py says why the pytest process itself
is no place to fork from), and each child is a fork of it.

What a spawned child gets from its parent at `start()`, a child here gets
too (PreloadedProcess says how): the parent's environment, applied before
the child imports the target's module (so `monkeypatch.setenv` before the
start reaches the driver the child loads, as it does a spawned one), its
stdout and stderr (pytest's capture of that test), its `sys.path` and its
working directory; and its exit runs the atexit handlers. What a spawned
child reads from its environment only at interpreter start (PYTHONPATH,
PYTHON* flags) or while importing numpy, torch or torch_rpc_ext (such as
OMP_NUM_THREADS) is the fork server's instead, as the parent had it when
the server started (its first child). So is the environment, stdout and
stderr under which a program run as a script (`__main__`, as the
benchmarks are) is imported again in the child, before the rest: its
top-level code must not depend on them. None of the tests and benchmarks
using this sets such a variable after its first child or reads one at its
top level (the driver and every TORCH_RPC_EXT_* and FAKE_CUDA_* variable
are read when first used; cuda_call_breakdown.py sets its one before any
child starts). Python's finalization does not run at a child's exit.
"""

import atexit
import ctypes
import multiprocessing
import os
import sys
from multiprocessing import context as _context
from multiprocessing import reduction

PRELOAD = ["numpy", "torch", "torch_rpc_ext"]


class _ParentFd:
    """One of the parent's file descriptors, as it is at start(), sent to the
    child the way multiprocessing sends a Connection's."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


def _child_of(env: dict, stdout: int, stderr: int):
    """Run first as the child unpickles its Process, before the target's
    module is imported: the environment, stdout and stderr its parent had
    at start()."""
    os.environ.clear()
    os.environ.update(env)
    for fd, to in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, to)
        os.close(fd)
    return PreloadedProcess.__new__(PreloadedProcess)


class PreloadedProcess(_context.ForkServerProcess):
    """multiprocessing hands a fork server's child its parent's sys.path and
    working directory (the preparation data spawn sends too), but not its
    environment or its stdout and stderr: those are the fork server's, as
    it started. This sends them as they are at start(), as a spawned child
    inherits them (the Process may be made earlier; pytest's capture moves
    fds 1 and 2 for each test), and applies them before the child imports
    anything of the test's. And a fork server's child ends with os._exit():
    this one runs what an interpreter's exit would first (Python's atexit
    handlers, then libc's exit(): C atexit handlers and static
    destructors), so that a worker that crashes or hangs at exit still
    fails its test. Python's own finalization (module teardown) does not
    run; tests of a process's exit spawn (`spawned` in
    tests/cuda_driver/conftest.py)."""

    def start(self):
        self._parent_state = (dict(os.environ), _ParentFd(1), _ParentFd(2))
        super().start()

    def __reduce__(self):
        state = dict(self.__dict__)
        return _child_of, state.pop("_parent_state"), state

    def _bootstrap(self, parent_sentinel=None):
        code = super()._bootstrap(parent_sentinel)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        ctypes.CDLL(None).exit(code)
        return code  # not reached


class PreloadedContext(_context.ForkServerContext):
    Process = PreloadedProcess


_CONTEXT = None


def context() -> PreloadedContext:
    """The context (one fork server per pytest process, started on first
    use with the PRELOAD modules imported)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = PreloadedContext()
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def start_context(kind: str | None = None):
    """`spawn` for kind "spawn", or without a kind where
    TORCH_RPC_EXT_TEST_START=spawn (the way to tell a test that fails under
    the fork server from one that fails anyway); else the preloaded
    context."""
    if (kind or os.environ.get("TORCH_RPC_EXT_TEST_START", "")) == "spawn":
        return multiprocessing.get_context("spawn")
    return context()
