# SPDX-License-Identifier: BSD-3-Clause
"""Train a model split between a trainer and a parameter server over TORCH_RPC_EXT.

The parameter server owns the embedding-like first layer; the trainer owns the
head. Every step runs the forward pass across both processes, backpropagates
with distributed autograd and updates both halves with DistributedOptimizer.

Run: python -m torch_rpc_ext.demo [--steps 200] [--batch 128]
"""

import argparse
import os
import socket
import time
import warnings

import torch
import torch.distributed.autograd as dist_autograd
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import rpc
from torch.distributed.optim import DistributedOptimizer

import torch_rpc_ext


class ServerHalf(nn.Module):
    """Lives on the parameter server: 32 -> 64 features."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(32, 64), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def parameter_rrefs(self) -> list:
        return [rpc.RRef(p) for p in self.parameters()]


def _call(method, rref, *args):
    return method(rref.local_value(), *args)


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable 4-class problem: the class is set by a hidden projection."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 4, generator=g)
    return x, (x @ w).argmax(dim=1)


def train(steps: int, batch: int) -> None:
    server = rpc.remote("ps", ServerHalf)
    head = nn.Linear(64, 4)
    params = rpc.rpc_sync("ps", _call, args=(ServerHalf.parameter_rrefs, server))
    params += [rpc.RRef(p) for p in head.parameters()]
    opt = DistributedOptimizer(torch.optim.Adam, params, lr=3e-3)
    x, y = make_data(4096)
    loss_fn = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        idx = torch.randint(0, x.shape[0], (batch,))
        with dist_autograd.context() as ctx:
            hidden = rpc.rpc_sync("ps", _call, args=(ServerHalf.forward, server, x[idx]))
            loss = loss_fn(head(hidden), y[idx])
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        if step == 1 or step % 25 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        hidden = rpc.rpc_sync("ps", _call, args=(ServerHalf.forward, server, x))
        accuracy = (head(hidden).argmax(dim=1) == y).float().mean().item()
    print(
        f"trained {steps} steps in {elapsed:.2f} s "
        f"({1000 * elapsed / steps:.2f} ms/step), accuracy {accuracy:.1%}",
        flush=True,
    )


def worker(rank: int, port: int, steps: int, batch: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # torch's functional optimizers warn about TorchScript; not ours to fix.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    name = "trainer" if rank == 0 else "ps"
    rpc.init_rpc(
        name,
        rank=rank,
        world_size=2,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
            num_worker_threads=8, rpc_timeout=60
        ),
    )
    if rank == 0:
        print(f"TORCH_RPC_EXT up: trainer + ps, torch {torch.__version__}", flush=True)
        train(steps, batch)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args.steps, args.batch), nprocs=2, join=True)


if __name__ == "__main__":
    main()
