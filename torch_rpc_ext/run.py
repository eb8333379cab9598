# SPDX-License-Identifier: BSD-3-Clause
"""Run an unmodified torch.distributed.rpc program on TORCH_RPC_EXT.

    python -m torch_rpc_ext.run script.py [args...]                 # the program starts its workers
    python -m torch_rpc_ext.run --nproc-per-node 4 script.py [args...]
    torchrun --nproc-per-node 4 -m torch_rpc_ext.run script.py [args...]

In the launched program and every Python process it starts, ``rpc.init_rpc``
without a backend, or with TensorPipe's backend and options, gets
TORCH_RPC_EXT: ``num_worker_threads``, ``rpc_timeout``, ``init_method``,
``device_maps`` and ``devices`` carry over, and TensorPipe-only settings
(``_transports``, ``_channels``) are reported once as ignored. A program that
asks for ``BackendType.TORCH_RPC_EXT`` (or another backend) is left as it is.
Each process says on stderr when it switches a worker to TORCH_RPC_EXT
(worker, what was asked for, what it got); ``TORCH_RPC_EXT_LOG=error``
silences it. Before running the program the launcher checks that a Python
process it starts will load its start-up hook, and fails, naming the cause,
if not. Without the launcher ``init_rpc`` is not patched.

With ``--nproc-per-node N`` the launcher starts N copies of the program with
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun
does, and exits with the first failure's status. A copy that fails, or
SIGTERM, SIGINT or SIGHUP to the launcher, stops the others: SIGTERM, then
SIGKILL after ``--stop-grace`` seconds (30).
"""

import argparse
import os
import signal
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from torch_rpc_ext._ports import free_port

__all__ = ["main"]

_PACKAGE = Path(__file__).resolve().parent
_LAUNCH_DIR = str(_PACKAGE / "_launch")
_HOOK = _PACKAGE / "_launch" / "sitecustomize.py"
_ROOT = str(_PACKAGE.parent)

# Run in a child Python with the launch environment: which sitecustomize it
# loaded and where it finds torch_rpc_ext (torch is not imported).
_PROBE_MARK = "torch_rpc_ext.run probe:"
_PROBE = f"""
import importlib.util, sys
hook = sys.modules.get("sitecustomize")
spec = importlib.util.find_spec("torch_rpc_ext")
ours = getattr(hook, "TORCH_RPC_EXT_HOOK", False)
print({_PROBE_MARK!r}, ours, spec.origin if spec else None)
"""


class HookError(RuntimeError):
    """The start-up hook would not be in place in the processes a launched
    program starts (they would run TensorPipe)."""


def check_hook() -> None:
    """Start a Python the way a launched program starts one (this
    interpreter, its flags, the launch environment) and check that it loads
    our start-up hook and imports this torch_rpc_ext.

    Raises:
        HookError: naming what is missing or in the way.
    """
    if not _HOOK.is_file():
        raise HookError(
            f"{_HOOK} is missing: this install of torch_rpc_ext is incomplete "
            "(reinstall it: pip install --no-build-isolation --force-reinstall .)"
        )
    probe_env = _launch_env(os.environ)
    probe_env["TORCH_RPC_EXT_LAUNCH"] = "probe"
    flags = subprocess._args_from_interpreter_flags()  # what multiprocessing passes on
    out = subprocess.run(
        [sys.executable, *flags, "-c", _PROBE], env=probe_env,
        capture_output=True, text=True, timeout=60,
    )
    # The last marked line: a chained sitecustomize may print too.
    marked = [line for line in out.stdout.splitlines() if line.startswith(_PROBE_MARK)]
    if out.returncode != 0 or not marked:
        raise HookError(f"a child Python failed to start: {out.stderr.strip()[-500:]}")
    hook, package = marked[-1][len(_PROBE_MARK):].split(maxsplit=1)
    if hook != "True":
        if ignores := {"-E", "-I"} & set(flags):
            why = f"this Python runs with {' '.join(sorted(ignores))}, which ignores PYTHONPATH"
        elif "-S" in flags:
            why = "this Python runs with -S, which loads no sitecustomize"
        else:
            why = "another sitecustomize module comes before it on the path"
        raise HookError(f"a child Python does not load {_HOOK}: {why}")
    if package == "None" or Path(package).resolve().parent != _PACKAGE:
        raise HookError(
            f"a child Python imports torch_rpc_ext from {package}, not {_PACKAGE}"
        )


def _installed() -> bool:
    """Whether torch_rpc_ext is imported from this Python's site-packages
    (else from a source tree, which children must be pointed at)."""
    sites = {
        sysconfig.get_path("purelib"), sysconfig.get_path("platlib"),
        *site.getsitepackages(), site.getusersitepackages(),
    }
    return any(Path(s).resolve() == Path(_ROOT) for s in sites if s)


def _launch_env(env: dict) -> dict:
    """``env`` plus what makes a Python load the start-up hook."""
    env = dict(env)
    env["TORCH_RPC_EXT_LAUNCH"] = "1"  # _launch/sitecustomize.py installs the patch then
    # Never site-packages itself on PYTHONPATH: every other Python the
    # program starts (another version, a tool's) would import from it.
    ours = [_LAUNCH_DIR] if _installed() else [_LAUNCH_DIR, _ROOT]
    paths = ours + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _run_here(script: str, args: list[str]) -> None:
    """Run ``script`` in this process, switched, as ``python script`` would:
    this process becomes a fresh Python (the same pid) with the launch
    environment, whose start-up hook switches init_rpc once the script
    imports torch. (Run here, after the launcher's own import of torch, a
    script's settings for torch made before its import were ignored:
    OMP_NUM_THREADS, TORCH_LOGS.)"""
    env = _launch_env(os.environ)
    flags = subprocess._args_from_interpreter_flags()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *flags, script, *args], env)


# Signals that stop the launch: each copy gets SIGTERM (as torchrun sends
# its workers), and those still running after the grace period SIGKILL.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _run_copies(n: int, addr: str, port: int, script: str, args: list[str],
                grace: float) -> int:
    """Start ``n`` switched copies as torchrun would; the first failure's
    status (128 + the signal's number if the launcher was told to stop).

    A copy that fails stops the others: SIGTERM, then SIGKILL after
    ``grace`` seconds. So does SIGTERM, SIGINT or SIGHUP to the launcher
    (before session 94 it ended at once and left its copies running)."""
    received: list[int] = []

    def stop(signum, _frame):
        received.append(signum)

    previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    procs = []
    status = 0
    kill_at = None  # when copies told to stop get SIGKILL

    def terminate(now: float) -> None:
        nonlocal kill_at
        if kill_at is None:
            kill_at = now + grace
            for other in procs:
                other.send_signal(signal.SIGTERM)

    try:
        for rank in range(n):
            if received:
                break
            env = _launch_env(os.environ)
            env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=addr, MASTER_PORT=str(port),
            )
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch_rpc_ext.run", script, *args], env=env))
        while procs:
            now = time.monotonic()
            if received:
                status = status or 128 + received[0]
                terminate(now)
            for p in list(procs):
                code = p.poll()
                if code is None:
                    continue
                procs.remove(p)
                if code != 0 and status == 0:
                    status = code if code > 0 else 128 - code
                    terminate(now)  # one failed: the group cannot finish
            if kill_at is not None and now >= kill_at:
                for p in procs:
                    p.kill()
            time.sleep(0.05)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for s, handler in previous.items():
            # (None: a handler installed from C, which Python cannot put back)
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
    if received and status == 0:
        status = 128 + received[0]  # told to stop before or after the copies ran
    return status


# The launcher's options that take a value (as "--opt value").
_VALUED = {"--nproc-per-node", "--nproc_per_node", "--master-addr", "--master_addr",
           "--master-port", "--master_port", "--stop-grace"}


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's arguments and the script, the script's arguments as
    given): argparse's REMAINDER dropped a "--" among the script's own."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[:i] + argv[i + 1:i + 2], argv[i + 2:]
        if not a.startswith("-") or a == "-":
            return argv[:i + 1], argv[i + 1:]
        # (argparse takes a prefix of a long option: "--nproc 2")
        valued = "=" not in a and a.startswith("--") and any(v.startswith(a) for v in _VALUED)
        i += 2 if valued else 1
    return argv, []


def main(argv: list[str] | None = None) -> int:
    head, script_args = _split_argv(sys.argv[1:] if argv is None else list(argv))
    p = argparse.ArgumentParser(prog="python -m torch_rpc_ext.run", description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=0,
                   help="start this many copies with torchrun's environment (default: run once, here)")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=0, help="default: a free port")
    p.add_argument("--stop-grace", type=float, default=30.0, metavar="SECONDS",
                   help="with --nproc-per-node: how long copies told to stop (SIGTERM, "
                        "when one failed or the launcher was signalled) have before "
                        "SIGKILL (default 30, as torchrun)")
    p.add_argument("script")
    cfg = p.parse_args(head)
    cfg.args = script_args
    try:
        check_hook()
    except HookError as e:
        print(f"torch_rpc_ext.run: {e}; processes the program starts would run "
              "TensorPipe, so nothing was launched", file=sys.stderr)
        return 2
    if cfg.nproc_per_node > 0:
        if not (cfg.stop_grace >= 0 and cfg.stop_grace < float("inf")):
            p.error(f"--stop-grace must be a finite number >= 0, got {cfg.stop_grace}")
        return _run_copies(cfg.nproc_per_node, cfg.master_addr, cfg.master_port or free_port(),
                           cfg.script, cfg.args, cfg.stop_grace)
    _run_here(cfg.script, cfg.args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
