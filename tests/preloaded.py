# SPDX-License-Identifier: BSD-3-Clause
"""Processes started as `spawn` starts them, without a fresh import of torch
each: children of a fork server that imported torch, numpy and
torch_rpc_ext once.

A spawned worker spends about 3 s of CPU importing torch (6 s beside a
second lane of tests); the fake-CUDA stage started 207 of them, most of its
CPU time. The fork server (multiprocessing's "forkserver") is a process of
its own that imported those modules and nothing more: it loaded no CUDA
driver and ran no torch compute, so it has no threads a fork could leave
half-copied (tests/cuda_driver/worker.py says why the pytest process itself
is no place to fork from), and each child is a fork of it.

What a spawned child gets from its parent at `start()`, a child here gets
too: the parent's environment (so `monkeypatch.setenv` before the start
reaches the driver the child loads, as it does a spawned one), its
`sys.path` and its working directory. What a spawned child reads from its
environment only at interpreter start (PYTHONPATH, PYTHON* flags) or while
importing torch, numpy or torch_rpc_ext is the fork server's instead; none
of the tests using this depends on that (the driver and every
TORCH_RPC_EXT_* variable are read when first used, not at import).
"""

import multiprocessing
import os
from multiprocessing import context as _context

PRELOAD = ["numpy", "torch", "torch_rpc_ext"]


class PreloadedProcess(_context.ForkServerProcess):
    """multiprocessing hands a fork server's child its parent's sys.path and
    working directory (the preparation data spawn sends too), not its
    environment: that is the fork server's. This takes it at start(), as
    spawn does (the Process may be made earlier)."""

    def start(self):
        self._parent_env = dict(os.environ)
        super().start()

    def run(self):
        os.environ.clear()
        os.environ.update(self._parent_env)
        super().run()


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
    """`spawn` where TORCH_RPC_EXT_TEST_START=spawn (the way to tell a test
    that fails under the fork server from one that fails anyway), else the
    preloaded context."""
    if (kind or os.environ.get("TORCH_RPC_EXT_TEST_START", "")) == "spawn":
        return multiprocessing.get_context("spawn")
    return context()
