# SPDX-License-Identifier: BSD-3-Clause
"""Workers started with mp.spawn (fresh interpreters, as pytorch/examples'
distributed/rpc programs start theirs), init_rpc with TensorPipe's options
and no backend; each worker prints one JSON line with the agent it got.

    python spawned.py PORT
    python -m torch_rpc_ext.run spawned.py PORT
"""

import json
import os
import sys

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


def worker(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options)
    peer = f"worker{(rank + 1) % world_size}"
    value = rpc.rpc_sync(peer, torch.add, args=(torch.tensor([rank]), 10)).item()
    agent = type(rpc.api._get_current_rpc_agent()).__name__
    # One write per line: the workers share stdout.
    sys.stdout.write(json.dumps({"rank": rank, "agent": agent, "value": value}) + "\n")
    sys.stdout.flush()
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2, join=True)
