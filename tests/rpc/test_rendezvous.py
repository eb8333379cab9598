# SPDX-License-Identifier: BSD-3-Clause
"""Rendezvous through every init_method kind, and under torchrun."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.distributed import rpc

import torch_rpc_ext
from tests.rpc.world import free_port, init, run_world

pytestmark = pytest.mark.timeout(180)


def ping_with(rank, world_size, init_method):
    rpc.init_rpc(
        f"w{rank}",
        rank=rank,
        world_size=world_size,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
            init_method=init_method, address="127.0.0.1", rpc_timeout=20
        ),
    )
    peer = f"w{(rank + 1) % world_size}"
    out = rpc.rpc_sync(peer, torch.add, args=(torch.ones(1), rank)).item()
    rpc.shutdown()
    return out


@pytest.mark.parametrize("kind", ["env", "tcp", "file"])
def test_every_init_method_kind(kind, tmp_path):
    if kind == "env":
        method = "env://"
    elif kind == "tcp":
        method = f"tcp://127.0.0.1:{free_port()}"
    else:
        method = f"file://{tmp_path / 'rendezvous'}"
    out = run_world(ping_with, world_size=3, init_method=method)
    assert out == {0: 1.0, 1: 2.0, 2: 3.0}


def slow_leaver(rank, world_size, delay_ms):
    if rank != 0:
        os.environ["TORCH_RPC_EXT_TEST_LEAVE_DELAY_MS"] = str(delay_ms)
    init(rank, world_size)
    rpc.rpc_sync(f"worker{(rank + 1) % world_size}", torch.add, args=(torch.ones(1), 1))
    t0 = time.monotonic()
    rpc.shutdown()
    return time.monotonic() - t0


def test_store_host_outlives_the_others_last_store_call():
    # rank 0 hosts the c10d store. Once the last shutdown barrier passes it
    # may exit (taking the store with it) while the others still talk to the
    # store: they then failed a join that had succeeded ("Connection reset by
    # peer"). Now rank 0 waits until each other rank's last store call has
    # landed, here held back 1 s after the barrier.
    out = run_world(slow_leaver, world_size=3, delay_ms=1000)
    assert out[0] >= 0.9, out


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import os, torch
    import torch.distributed.rpc as rpc
    import torch_rpc_ext
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=ws,
                 rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions())
    got = rpc.rpc_sync(f"w{1 - rank}", torch.mul, args=(torch.ones(1), 21)).item()
    print(f"rank {rank} got {got}", flush=True)
    rpc.shutdown()
    """
)


def test_torchrun_launch_with_inferred_backend(tmp_path, launched_tmpdir):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, TORCH_RPC_EXT_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         f"--master-port={free_port()}", str(script)],
        capture_output=True, text=True, timeout=150, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 got 21.0" in proc.stdout and "rank 1 got 21.0" in proc.stdout
