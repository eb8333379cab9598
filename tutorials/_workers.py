# SPDX-License-Identifier: BSD-3-Clause
"""Functions the tutorials run in worker processes (must be importable)."""

import os

import torch
from torch.distributed import rpc

import torch_rpc_ext


def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


def quickstart(rank: int, port: int, results) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=2,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(num_worker_threads=4),
    )
    if rank == 0:
        x = torch.arange(4.0)
        results["rpc_sync"] = rpc.rpc_sync("worker1", square, args=(x,)).tolist()
        fut = rpc.rpc_async("worker1", torch.add, args=(x, 10))
        results["rpc_async"] = fut.wait().tolist()
        rref = rpc.remote("worker1", square, args=(x + 1,))
        results["rref"] = (rref.owner().name, rref.to_here().tolist())
        metrics = rpc.api._get_current_rpc_agent().get_metrics()
        results["calls_sent"] = metrics["rpc_ext.peer.worker1.calls_sent"]
    rpc.shutdown()
