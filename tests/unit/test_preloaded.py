# SPDX-License-Identifier: BSD-3-Clause
"""torch_rpc_ext/_preloaded.py: a fork server's child gets what a spawned one gets
from its parent at start(). tests/cuda_driver relies on it: a
`monkeypatch.setenv` (FAKE_CUDA_KERNEL_DELAY_MS, TORCH_RPC_EXT_*) that did
not reach the child would leave those tests passing without what they set
up."""

import os
import sys
from multiprocessing import forkserver

from torch_rpc_ext import _preloaded as preloaded

# What a child saw while it imported the target's module (this one).
_VALUE_AT_IMPORT = os.environ.get("PRELOADED_TEST_VALUE")


def _report(conn):
    conn.send({
        "env": os.environ.get("PRELOADED_TEST_VALUE"),
        "env_at_import": _VALUE_AT_IMPORT,
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
    assert got["env"] == got["env_at_import"] == "started" and not got["gone"]
    assert got["path0"] == str(tmp_path)
    assert got["cwd"] == str(tmp_path)
    assert got["torch_before_target"]  # the server's import, not the child's
    assert got["pid"] != os.getpid()


def test_spawn_can_be_asked_for(monkeypatch):
    monkeypatch.setenv("TORCH_RPC_EXT_TEST_START", "spawn")
    assert preloaded.start_context().get_start_method() == "spawn"
    monkeypatch.delenv("TORCH_RPC_EXT_TEST_START")
    assert isinstance(preloaded.start_context(), preloaded.PreloadedContext)


def _write_and_leave(code):
    import atexit

    sys.stderr.write("child stderr line\n")
    atexit.register(lambda: sys.stderr.write(f"atexit ran, leaving with {code}\n"))
    sys.exit(code)


def test_a_child_writes_to_its_parents_stderr_and_runs_its_exit_handlers(capfd):
    """pytest moves fds 1 and 2 for each test; a spawned child writes where
    they were at its start, and at its exit runs its atexit handlers (a
    fork server's child would write to the server's stderr and end with
    os._exit())."""
    ctx = preloaded.context()
    forkserver.ensure_running()
    proc = ctx.Process(target=_write_and_leave, args=(3,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 3
    err = capfd.readouterr().err
    assert "child stderr line" in err and "atexit ran, leaving with 3" in err, err
