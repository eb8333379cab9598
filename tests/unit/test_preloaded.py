# SPDX-License-Identifier: BSD-3-Clause
"""tests/preloaded.py: a fork server's child gets what a spawned one gets
from its parent at start(). tests/cuda_driver relies on it: a
`monkeypatch.setenv` (FAKE_CUDA_KERNEL_DELAY_MS, TORCH_RPC_EXT_*) that did
not reach the child would leave those tests passing without what they set
up."""

import os
import sys
from multiprocessing import forkserver

from tests import preloaded


def _report(conn):
    conn.send({
        "env": os.environ.get("PRELOADED_TEST_VALUE"),
        "gone": "PRELOADED_TEST_GONE" in os.environ,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "torch_before_target": "torch" in sys.modules,
        "pid": os.getpid(),
    })


def test_a_child_takes_its_parents_environment_path_and_directory_at_start(
        tmp_path, monkeypatch):
    ctx = preloaded.context()
    # The server runs before the test changes anything, as it does for
    # every test after the first in a session.
    forkserver.ensure_running()
    monkeypatch.setenv("PRELOADED_TEST_VALUE", "made")
    monkeypatch.setenv("PRELOADED_TEST_GONE", "1")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_report, args=(theirs,))
    # After the Process was made, before it starts: what spawn would see.
    monkeypatch.setenv("PRELOADED_TEST_VALUE", "started")
    monkeypatch.delenv("PRELOADED_TEST_GONE")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    proc.start()
    try:
        assert ours.poll(60), "the child reported nothing"
        got = ours.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    assert got["env"] == "started" and not got["gone"]
    assert got["path0"] == str(tmp_path)
    assert got["cwd"] == str(tmp_path)
    assert got["torch_before_target"]  # the server's import, not the child's
    assert got["pid"] != os.getpid()


def test_spawn_can_be_asked_for(monkeypatch):
    monkeypatch.setenv("TORCH_RPC_EXT_TEST_START", "spawn")
    assert preloaded.start_context().get_start_method() == "spawn"
    monkeypatch.delenv("TORCH_RPC_EXT_TEST_START")
    assert isinstance(preloaded.start_context(), preloaded.PreloadedContext)
