# SPDX-License-Identifier: BSD-3-Clause
"""Pipeline parallelism over two RemoteModule shards: micro-batches flow
shard1 -> shard2 with rpc_async, trained with distributed autograd and
DistributedOptimizer; written for TensorPipe, with init_rpc given no backend
at all. Prints one JSON line.

    python pipeline.py PORT
    python -m torch_rpc_ext.run pipeline.py PORT
"""

import json
import os
import sys

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch import optim
from torch.distributed.nn.api.remote_module import RemoteModule
from torch.distributed.optim import DistributedOptimizer


class Shard1(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU())

    def forward(self, x):
        return self.net(x)


class Shard2(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Linear(16, 4)

    def forward(self, x):
        return self.net(x)


class DistNet(nn.Module):
    def __init__(self, split_size):
        super().__init__()
        self.split_size = split_size
        self.p1 = RemoteModule("worker1/cpu", Shard1)
        self.p2 = RemoteModule("worker2/cpu", Shard2)

    def forward(self, xs):
        futs = [self.p2.forward_async(self.p1.forward(x)) for x in xs.split(self.split_size)]
        return torch.cat(torch.futures.wait_all(futs))

    def parameter_rrefs(self):
        return self.p1.remote_parameters() + self.p2.remote_parameters()


def run_master():
    model = DistNet(split_size=4)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
    loss_fn = nn.MSELoss()
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(5):
        inputs, labels = torch.randn(12, 8, generator=gen), torch.randn(12, 4, generator=gen)
        with dist_autograd.context() as ctx:
            loss = loss_fn(model(inputs), labels)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        losses.append(loss.item())
    agent = type(rpc.api._get_current_rpc_agent()).__name__
    print(json.dumps({"program": "pipeline", "agent": agent, "losses": losses}), flush=True)


def run(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port
    rpc.init_rpc("master" if rank == 0 else f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        run_master()
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run, args=(3, sys.argv[1]), nprocs=3, join=True)
