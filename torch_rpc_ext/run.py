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
Without the launcher nothing of torch is patched.

With ``--nproc-per-node N`` the launcher starts N copies of the program with
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun
does, and exits with the first failure's status.
"""

import argparse
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main"]

_LAUNCH_DIR = str(Path(__file__).resolve().parent / "_launch")
_ROOT = str(Path(__file__).resolve().parent.parent)


def _launch_env(env: dict) -> dict:
    env = dict(env)
    env["TORCH_RPC_EXT_LAUNCH"] = "1"  # _launch/sitecustomize.py installs the patch then
    paths = [_LAUNCH_DIR, _ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_here(script: str, args: list[str]) -> None:
    os.environ.update(_launch_env(os.environ))
    # This process started before the variables were set: install here too.
    from torch_rpc_ext import _launcher

    _launcher.install()
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def _run_copies(n: int, addr: str, port: int, script: str, args: list[str]) -> int:
    procs = []
    for rank in range(n):
        env = _launch_env(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=addr, MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "torch_rpc_ext.run", script, *args], env=env))
    status = 0
    try:
        while procs:
            for p in list(procs):
                code = p.poll()
                if code is None:
                    continue
                procs.remove(p)
                if code != 0 and status == 0:
                    status = code
                    for other in procs:  # one failed: the group cannot finish
                        other.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    finally:
        for p in procs:
            p.kill()
    return status if status >= 0 else 128 - status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_rpc_ext.run", description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=0,
                   help="start this many copies with torchrun's environment (default: run once, here)")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=0, help="default: a free port")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    cfg = p.parse_args(argv)
    if cfg.nproc_per_node > 0:
        return _run_copies(cfg.nproc_per_node, cfg.master_addr, cfg.master_port or _free_port(),
                           cfg.script, cfg.args)
    _run_here(cfg.script, cfg.args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
