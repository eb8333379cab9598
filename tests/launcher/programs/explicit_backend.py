# SPDX-License-Identifier: BSD-3-Clause
"""A TensorPipe program changed in its backend only: mp.spawn workers call
init_rpc with backend=TORCH_RPC_EXT and their TensorPipeRpcBackendOptions
(including a TensorPipe-only _transports). No launcher. Each worker prints
one JSON line: its agent and the timeout it got.

    python explicit_backend.py PORT
"""

import json
import os
import sys

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

import torch_rpc_ext  # noqa: F401  (registers BackendType.TORCH_RPC_EXT)


def worker(rank: int, world_size: int, port: str) -> None:
    """One worker: init, one call to the next, report, shut down."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=5, rpc_timeout=42,
                                              _transports=["uv"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=options)
    peer = f"worker{(rank + 1) % world_size}"
    value = rpc.rpc_sync(peer, torch.add, args=(torch.tensor([rank]), 10)).item()
    agent = rpc.api._get_current_rpc_agent()
    row = {"rank": rank, "agent": type(agent).__name__, "value": value,
           "timeout": rpc.get_rpc_timeout(),
           "threads": int(agent.get_debug_info()["agent.thread_pool_size"])}
    sys.stdout.write(json.dumps(row) + "\n")  # one write: the workers share stdout
    sys.stdout.flush()
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2, join=True)
