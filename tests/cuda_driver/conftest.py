# SPDX-License-Identifier: BSD-3-Clause
"""The driver for this folder's tests: the machine's own where it has one
(a GPU machine: tools/gpu_check.sh), else the fake (tests/cuda_fake, built
once); loaded only by processes of their own, never this one (worker.py
says why; torch_rpc_ext/_preloaded.py how they start)."""

import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tests import cuda_fake
from tests.cuda_driver import worker
from tests.remote import Remote
from torch_rpc_ext import _preloaded as preloaded


def _start(env: dict[str, str]) -> None:
    os.environ.update(env)


def _real_devices() -> int:
    """The GPUs of a real driver (cuInit succeeds), or -1 without one, asked
    in a child so this process never initialises CUDA. dlopen itself is
    asked, not ldconfig: GPU machines often have libcuda only on
    LD_LIBRARY_PATH."""
    code = (
        "import ctypes\n"
        "try:\n"
        "    lib = ctypes.CDLL('libcuda.so.1')\n"
        "    n = ctypes.c_int(0)\n"
        "    ok = lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0\n"
        "    print(n.value if ok else -1)\n"
        "except OSError:\n"
        "    print(-1)\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return -1
    try:
        return int(out.stdout.strip())
    except ValueError:
        return -1


REAL_DEVICES = _real_devices()
REAL_DRIVER = REAL_DEVICES >= 0
# Without a GPU these tests drive the fake driver through a CPU torch, which
# holds its memory as CUDA tensors under a fake device guard. A CUDA build of
# torch has its own guard and allocator, bound to the real driver: the fake
# cannot stand in for them there.
FAKE_NEEDS_CPU_TORCH = (
    "no GPU here, and torch " + torch.__version__ + " is a CUDA build: the fake driver "
    "needs a CPU torch (tools/test.sh runs this folder on its default torch, a CPU one)"
    if not REAL_DRIVER and torch.version.cuda is not None else None)


def pytest_collection_modifyitems(config, items):
    if FAKE_NEEDS_CPU_TORCH is None:
        return
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason=FAKE_NEEDS_CPU_TORCH)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
# What only the fake can drive (its FAKE_CUDA_* settings: devices, limits,
# versions, missing features), skipped on a GPU; what needs two GPUs there.
fake_only = pytest.mark.skipif(REAL_DRIVER, reason="drives the fake driver's settings")
two_devices = pytest.mark.skipif(
    REAL_DRIVER and REAL_DEVICES < 2, reason="maps between two GPUs: needs two")
# The landing pool on a GPU needs torch 2.13 (torch_rpc_ext._cuda.landing_pool:
# pytorch#175015); the fake models 2.13's pools on any torch.
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
landing_pool_torch = pytest.mark.skipif(
    REAL_DRIVER and _TORCH < (2, 13),
    reason="the landing pool needs torch 2.13 or newer on a GPU (pytorch#175015)")


@pytest.fixture(scope="session")
def driver_env() -> dict[str, str]:
    """The environment a process needs to load the driver under test."""
    if REAL_DRIVER:
        return {}
    return {"TORCH_RPC_EXT_LIBCUDA": str(cuda_fake.build())}


@pytest.fixture(scope="session")
def driver(driver_env):
    with ProcessPoolExecutor(1, _context(), initializer=_start, initargs=(driver_env,)) as pool:
        yield Remote(pool, worker)


def _context():
    """How this folder starts its processes: from the fork server that
    imported torch once (torch_rpc_ext/_preloaded.py: 207 spawns of torch were most
    of this folder's CPU time on the fake), or spawned on a real driver, as
    every GPU run so far has run them."""
    return preloaded.start_context("spawn" if REAL_DRIVER else None)


def _loading_the_driver(driver_env, monkeypatch, context):
    for key, value in driver_env.items():
        monkeypatch.setenv(key, value)
    return context


@pytest.fixture
def spawn(driver_env, monkeypatch):
    """A context (`spawn`'s semantics) whose processes load the driver under
    test."""
    return _loading_the_driver(driver_env, monkeypatch, _context())


@pytest.fixture
def spawned(driver_env, monkeypatch):
    """`spawn` itself, for a test of what a process does as it exits:
    interpreter finalization runs there, and not in a fork server's child."""
    return _loading_the_driver(driver_env, monkeypatch, preloaded.start_context("spawn"))


@pytest.fixture
def slow_kernels(monkeypatch):
    """The fake runs each kernel 50 ms after its stream reaches it, so a
    reader not ordered after a copy (by its event) sees the old bytes. (A
    real driver ignores the variable.)"""
    monkeypatch.setenv("FAKE_CUDA_KERNEL_DELAY_MS", "50")


def report(proc, ctl, who: str, limit: float = 120):
    """What `proc` sent down `ctl`; None if it exited with 0 without a word.
    Fails at once, naming it, when it exits with an error first (its peer
    may wait on it for good: CI once waited out a test's limit behind a
    receiver dead of a failed connection), and after `limit` seconds if it
    neither reported nor exited (one with a watchdog, as ipc_worker's, has
    printed its stacks by then)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if ctl.poll(0.2):
            return ctl.recv()
        if proc.exitcode is not None:
            if ctl.poll(0):
                return ctl.recv()
            assert proc.exitcode == 0, (
                f"the {who} exited with {proc.exitcode} before its report "
                "(its traceback is in the captured stderr)")
            return None
    raise AssertionError(f"the {who} reported nothing in {limit:.0f} s")
