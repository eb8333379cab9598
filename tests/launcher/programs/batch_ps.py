# SPDX-License-Identifier: BSD-3-Clause
"""A parameter server that updates its model once per batch of trainers'
gradients, with @rpc.functions.async_execution, written for TensorPipe in the
style of upstream's batch-updating parameter server example. Prints one JSON
line (the server's final weights).

    python batch_ps.py PORT
    python -m torch_rpc_ext.run batch_ps.py PORT
"""

import json
import os
import sys
import threading

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch import optim

TRAINERS = 2
BATCHES = 4


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size=TRAINERS):
        torch.manual_seed(0)
        self.model = nn.Linear(6, 3)
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


class Trainer:
    def __init__(self, ps_rref):
        self.ps_rref = ps_rref
        self.loss_fn = nn.MSELoss()

    def batches(self):
        gen = torch.Generator().manual_seed(10 + rpc.get_worker_info().id)
        for _ in range(BATCHES):
            yield torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)

    def train(self):
        m = self.ps_rref.rpc_sync().get_model()
        for inputs, labels in self.batches():
            self.loss_fn(m(inputs), labels).backward()
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.parameters()]),
            )


def run_trainer(ps_rref):
    Trainer(ps_rref).train()


def run_ps(trainers):
    ps_rref = rpc.RRef(BatchUpdateParameterServer())
    futs = [rpc.rpc_async(t, run_trainer, args=(ps_rref,)) for t in trainers]
    torch.futures.wait_all(futs)
    model = ps_rref.local_value().model
    agent = type(rpc.api._get_current_rpc_agent()).__name__
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    print(json.dumps({"program": "batch_ps", "agent": agent, "weights": weights}), flush=True)


def run(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60)
    if rank == 0:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        run_ps([f"trainer{r}" for r in range(1, world_size)])
    else:
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run, args=(TRAINERS + 1, sys.argv[1]), nprocs=TRAINERS + 1, join=True)
