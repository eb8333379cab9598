# SPDX-License-Identifier: BSD-3-Clause
"""python -m torch_rpc_ext.run: unmodified programs written for TensorPipe
(tests/launcher/programs, in the style of upstream's RPC examples) run on
TORCH_RPC_EXT and give TensorPipe's results; TensorPipe-only settings are
reported as ignored; each switch is reported; without the launcher init_rpc
is not patched, and TORCH_RPC_EXT translates TensorPipe's options itself."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rpc.world import free_port

# torchrun leaves a log folder per launch in TMPDIR: launched_tmpdir
# (tests/conftest.py) puts it in tmp_path.
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("launched_tmpdir")]

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = Path(__file__).resolve().parent / "programs"


def run(*argv: str, launcher: bool) -> subprocess.CompletedProcess:
    """Runs a program; an argument "PORT" becomes a free port. A port taken
    between free_port() and the program's bind (another process's
    ephemeral port, on a loaded machine) is tried once more with another."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TORCH_RPC_EXT_LAUNCH", None)
    for attempt in range(2):
        args = [str(free_port()) if a == "PORT" else a for a in argv]
        cmd = [sys.executable, *(["-m", "torch_rpc_ext.run"] if launcher else []), *args]
        proc = subprocess.run(cmd, cwd=PROGRAMS, env=env, capture_output=True, text=True,
                              timeout=240)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr or attempt == 1:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(
    "program, key, workers",
    [
        ("rnn_ps.py", "losses", 2),
        ("batch_ps.py", "weights", 3),
        ("pipeline.py", "losses", 3),
        ("rl_observers.py", "losses", 3),
    ],
)
def test_program_gives_tensorpipes_results_under_the_launcher(program, key, workers):
    (tp,) = json_lines(run(program, "PORT", launcher=False).stdout)
    launched = run(program, "PORT", launcher=True)
    (ours,) = json_lines(launched.stdout)
    assert tp["agent"] == "TensorPipeAgent"
    assert ours["agent"] == "Agent"  # torch_rpc_ext._C.Agent
    flat = lambda v: [x for row in v for x in row] if v and isinstance(v[0], list) else v  # noqa: E731
    assert flat(ours[key]) == pytest.approx(flat(tp[key]), rel=1e-5, abs=1e-6)
    if program == "rl_observers.py":
        assert ours["rewards"] == tp["rewards"]
        assert "_channels=['basic']" in launched.stderr
    # One line per worker the launcher switched, naming it.
    switched = [line for line in launched.stderr.splitlines() if line.startswith("torch_rpc_ext.run: worker ")]
    assert len(switched) == workers, launched.stderr[-2000:]
    assert all(line.endswith("runs BackendType.TORCH_RPC_EXT") for line in switched)
    if program == "rnn_ps.py":
        # _transports=["uv"]: reported by each process, once.
        notes = [line for line in launched.stderr.splitlines() if "ignoring TensorPipe-only" in line]
        assert len(notes) == 2, launched.stderr[-2000:]
        assert "_transports=['uv']" in notes[0]


def test_nproc_per_node_starts_a_torchrun_style_world():
    proc = run("--nproc-per-node", "3", "env_world.py", launcher=True)
    rows = sorted(json_lines(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2]
    assert all(r["agent"] == "Agent" for r in rows)
    assert [r["value"] for r in rows] == [10, 11, 12]  # each rank: its rank + 10, added by the next


def test_under_torchrun():
    proc = run(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "torch_rpc_ext.run", "env_world.py", launcher=False,
    )
    rows = sorted(json_lines(proc.stdout), key=lambda r: r["rank"])
    assert [(r["rank"], r["agent"], r["value"]) for r in rows] == [(0, "Agent", 10), (1, "Agent", 11)]


def test_a_failing_copy_fails_the_launch(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "torch_rpc_ext.run", "--nproc-per-node", "2", str(bad)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 3


SLEEPER = """
import os, pathlib, signal, sys, time
if "ignore" in sys.argv[1]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path(sys.argv[2], "pid-" + os.environ["RANK"]).write_text(str(os.getpid()))
if "fail" in sys.argv[1] and os.environ["RANK"] == "1":
    while not pathlib.Path(sys.argv[2], "pid-0").exists():  # rank 0 ignores SIGTERM by then
        time.sleep(0.01)
    sys.exit(3)
time.sleep(120)
"""


def launch_sleepers(tmp_path, mode, *flags):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "torch_rpc_ext.run", "--nproc-per-node", "2", *flags,
         str(script), mode, str(tmp_path)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def pids_of(tmp_path, ranks):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        files = [tmp_path / f"pid-{r}" for r in ranks]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError("the copies did not start")


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_signalled_launcher_stops_its_copies(tmp_path):
    """A scheduler stops a job with SIGTERM: the launcher passes it on and
    exits once its copies have (128 + 15). Before (a helper's reading in
    session 94), it ended at once and left both copies running."""
    launcher = launch_sleepers(tmp_path, "sleep")
    try:
        pids = pids_of(tmp_path, (0, 1))
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 128 + signal.SIGTERM
        assert all(gone(pid) for pid in pids)
    finally:
        launcher.kill()
        for pid in pids_of(tmp_path, (0, 1)):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_copy_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    """One copy fails (3): the others get SIGTERM, and SIGKILL once
    --stop-grace has passed; before, a copy that ignored SIGTERM held the
    launch for ever."""
    launcher = launch_sleepers(tmp_path, "ignore,fail", "--stop-grace", "1")
    try:
        t0 = time.monotonic()
        assert launcher.wait(60) == 3
        assert time.monotonic() - t0 < 30
        assert all(gone(pid) for pid in pids_of(tmp_path, (0, 1)))
    finally:
        launcher.kill()
        for pid in pids_of(tmp_path, (0, 1)):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_without_the_launcher_nothing_is_patched():
    code = (
        "import torch.distributed.rpc as rpc; import torch_rpc_ext;"
        "assert not getattr(rpc.init_rpc, '_torch_rpc_ext_launcher', False);"
        "print('untouched')"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "untouched", out.stderr


def test_the_scripts_arguments_pass_as_given():
    # argparse's REMAINDER dropped a "--" among them.
    from torch_rpc_ext.run import _split_argv

    assert _split_argv(["train.py", "--", "--x"]) == (["train.py"], ["--", "--x"])
    assert _split_argv(["--nproc-per-node", "2", "--stop-grace", "5", "t.py", "-v", "--"]) == (
        ["--nproc-per-node", "2", "--stop-grace", "5", "t.py"], ["-v", "--"])
    assert _split_argv(["--", "t.py", "a"]) == (["t.py"], ["a"])
    # A prefix of a long option, as argparse takes it.
    assert _split_argv(["--nproc", "2", "t.py", "x"]) == (["--nproc", "2", "t.py"], ["x"])
    assert _split_argv(["--stop-grace=3", "t.py"]) == (["--stop-grace=3", "t.py"], [])
    script = "import sys, json; print(json.dumps(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "argv.py")
        with open(path, "w") as f:
            f.write(script)
        out = subprocess.run(
            [sys.executable, "-m", "torch_rpc_ext.run", path, "--", "--x", "y"],
            env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == '["--", "--x", "y"]', out.stdout


SETS_BEFORE_TORCH = """
import os, sys
os.environ["OMP_NUM_THREADS"] = "1"
assert "torch" not in sys.modules, "torch imported before the program's first line"
import torch
import torch.distributed.rpc as rpc
print("threads", torch.get_num_threads(), getattr(rpc.init_rpc, "_torch_rpc_ext_launcher", False))
"""


@pytest.mark.parametrize("flags", [[], ["--nproc-per-node", "1"]])
def test_a_program_sets_what_torch_reads_at_import_before_importing_it(tmp_path, flags):
    # The launcher imported torch before the program ran (and the hook in
    # every Python it started did, at start-up): OMP_NUM_THREADS set by the
    # program was ignored. (torch takes at most the host's cores from it,
    # so 1: on a one-core host this shows nothing.)
    script = tmp_path / "before_torch.py"
    script.write_text(SETS_BEFORE_TORCH)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-m", "torch_rpc_ext.run", *flags, str(script)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "threads 1 True" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_another_backends_options_pick_that_backend_under_the_launcher():
    # Upstream picks the backend whose options were given; the launcher took
    # every backend=None call for ours, and dropped those options.
    from torch.distributed import rpc

    from torch_rpc_ext import RpcExtBackendOptions
    from torch_rpc_ext._launcher import _takes

    class OtherOptions(rpc.RpcBackendOptions):
        pass

    assert _takes(None, None) and _takes(None, rpc.TensorPipeRpcBackendOptions())
    assert _takes(None, RpcExtBackendOptions()) and _takes(None, rpc.RpcBackendOptions())
    assert _takes(rpc.BackendType.TENSORPIPE, OtherOptions())
    assert not _takes(None, OtherOptions())


def test_options_translation(capfd):
    import torch
    from torch.distributed import rpc

    from torch_rpc_ext import RpcExtBackendOptions
    from torch_rpc_ext import _tensorpipe_options as _launcher

    tp = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=7, rpc_timeout=12, init_method="tcp://127.0.0.1:1234"
    )
    ours = _launcher.translate_options(tp)
    assert isinstance(ours, RpcExtBackendOptions)
    assert (ours.num_worker_threads, ours.rpc_timeout, ours.init_method) == (7, 12, "tcp://127.0.0.1:1234")
    assert _launcher.translate_options(None).num_worker_threads == RpcExtBackendOptions().num_worker_threads
    mine = RpcExtBackendOptions(num_worker_threads=3)
    assert _launcher.translate_options(mine) is mine
    maps = rpc.TensorPipeRpcBackendOptions(device_maps={"w1": {"cpu": "cpu"}})
    assert _launcher.translate_options(maps).device_maps == {"w1": {torch.device("cpu"): torch.device("cpu")}}

    # TensorPipe-only settings: named once per process and value, on stderr.
    capfd.readouterr()
    odd = rpc.TensorPipeRpcBackendOptions(_transports=["ibv"], _channels=["cma"])
    _launcher.translate_options(odd)
    _launcher.translate_options(odd)
    err = capfd.readouterr().err.splitlines()
    assert err == [
        "torch_rpc_ext: ignoring TensorPipe-only settings _transports=['ibv'], "
        "_channels=['cma']: TORCH_RPC_EXT chooses its transports and channels per "
        "peer (RpcExtBackendOptions(transports=..., channels=...))"
    ]
    with pytest.raises(TypeError, match="takes RpcExtBackendOptions or TensorPipeRpcBackendOptions, got"):
        _launcher.translate_options({"rpc_timeout": 5})


def test_only_the_backend_changed_runs_on_ours_with_tensorpipes_options():
    proc = run("explicit_backend.py", "PORT", launcher=False)
    rows = sorted(json_lines(proc.stdout), key=lambda r: r["rank"])
    assert [(r["agent"], r["value"], r["timeout"]) for r in rows] == [
        ("Agent", 10, 42), ("Agent", 11, 42)
    ]
    # num_worker_threads=5 taken, not the default 16; the pool adds a thread
    # for a task none took within 20 ms (thread_pool.cpp), which a loaded
    # host can make happen.
    assert all(5 <= r["threads"] < 16 for r in rows), rows
    notes = [line for line in proc.stderr.splitlines() if "ignoring TensorPipe-only" in line]
    assert len(notes) == 2 and all("_transports=['uv']" in n for n in notes), proc.stderr[-2000:]


def test_children_get_the_switch_a_broken_one_refuses_rpc_and_user_hooks_still_run(tmp_path):
    # A user's own sitecustomize (on PYTHONPATH) still runs in every child.
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text(
        "import sys; sys.stderr.write('user sitecustomize ran\\n')\n")
    # A torch_rpc_ext that cannot load, first on the second child's path.
    planted = tmp_path / "planted" / "torch_rpc_ext"
    planted.mkdir(parents=True)
    (planted / "__init__.py").write_text("raise ImportError('planted breakage')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(user)]))
    env.pop("TORCH_RPC_EXT_LAUNCH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch_rpc_ext.run", "children.py", str(planted.parent),
         str(free_port())],
        cwd=PROGRAMS, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (seen,) = json_lines(proc.stdout)
    assert seen["good"] == {"switched": True, "init": "Agent"}
    assert not seen["broken"]["switched"] and "init" not in seen["broken"]
    assert seen["broken"]["error"].startswith(
        "torch_rpc_ext.run: cannot switch init_rpc to TORCH_RPC_EXT in process ")
    assert "ImportError: planted breakage; refusing to start TensorPipe" in seen["broken"]["error"]
    # The probe, both children: the user's hook ran after ours each time.
    assert proc.stderr.count("user sitecustomize ran") >= 3, proc.stderr[-2000:]


def test_each_note_is_one_write(monkeypatch):
    # Workers share stderr; under PYTHONUNBUFFERED=1 each write() is a
    # syscall, so a note written in two pieces (print's text, then its
    # newline) could be spliced with another worker's (seen in CI).
    from torch_rpc_ext._tensorpipe_options import note

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, s):
            self.writes.append(s)

        def flush(self):
            pass

    rec = Recorder()
    monkeypatch.setattr(sys, "stderr", rec)
    monkeypatch.delenv("TORCH_RPC_EXT_LOG", raising=False)
    note("worker 'a' (rank 0) asked for no backend; runs BackendType.TORCH_RPC_EXT", who="torch_rpc_ext.run")
    assert rec.writes == [
        "torch_rpc_ext.run: worker 'a' (rank 0) asked for no backend; runs BackendType.TORCH_RPC_EXT\n"
    ]
