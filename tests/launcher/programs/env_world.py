# SPDX-License-Identifier: BSD-3-Clause
"""A torchrun-style program: rank and world size from the environment,
init_rpc with no backend, each worker calls the next. Prints one JSON line
per worker."""

import json
import os
import sys

import torch
import torch.distributed.rpc as rpc

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
peer = f"worker{(rank + 1) % world_size}"
value = rpc.rpc_sync(peer, torch.add, args=(torch.tensor([rank]), 10)).item()
agent = type(rpc.api._get_current_rpc_agent()).__name__
# One write per line: the workers share stdout.
sys.stdout.write(json.dumps({"rank": rank, "agent": agent, "value": value}) + "\n")
sys.stdout.flush()
rpc.shutdown()
