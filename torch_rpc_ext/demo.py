# SPDX-License-Identifier: BSD-3-Clause
"""Train a model split between a trainer and a parameter server over TORCH_RPC_EXT.

The parameter server owns the first layer (32 -> 64 features); the trainer
owns the head. Every step runs the forward pass across both processes, backpropagates
with distributed autograd and updates both halves with DistributedOptimizer.
With --backend TENSORPIPE the same program runs over TensorPipe for comparison;
the seeds are fixed, so both backends print the same losses.

Run: python -m torch_rpc_ext.demo [--epochs 5] [--batch 128] [--backend TENSORPIPE]
"""

import argparse
import os
import time
import warnings

import torch
import torch.distributed.autograd as dist_autograd
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import rpc
from torch.distributed.optim import DistributedOptimizer

import torch_rpc_ext

BACKENDS = {
    "TORCH_RPC_EXT": torch_rpc_ext.RpcExtBackendOptions,
    "TENSORPIPE": rpc.TensorPipeRpcBackendOptions,
}


def quiet_known_torch_warnings() -> None:
    """Hide the two warnings torch prints on every run of this program, no others.

    DistributedOptimizer's functional optimizers (compiled with TorchScript
    before torch 2.14, Python objects since) warn that TorchScript support for
    them is deprecated from inside ``catch_warnings(); simplefilter("always")``,
    which outranks any filter, so that one is dropped where it is shown.
    TensorPipe's shutdown warns that it passes a Gloo backend as a process group.
    """
    warnings.filterwarnings(
        "ignore", message="You are using a Backend .* as a ProcessGroup",
        category=UserWarning, module="torch.distributed.distributed_c10d",
    )
    show = warnings.showwarning

    def showwarning(message, category, filename, *args, **kwargs):
        if category is DeprecationWarning and str(message).startswith(
            "`TorchScript` support for functional optimizers is deprecated"
        ):
            return
        show(message, category, filename, *args, **kwargs)

    warnings.showwarning = showwarning


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


def agent_metrics() -> dict[str, str]:
    return rpc.api._get_current_rpc_agent().get_metrics()


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable 4-class problem: the class is set by a hidden projection."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 4, generator=g)
    return x, (x @ w).argmax(dim=1)


def train(epochs: int, batch: int) -> tuple[int, float]:
    """Returns the number of steps and the seconds they took."""
    server = rpc.remote("ps", ServerHalf)
    torch.manual_seed(0)
    head = nn.Linear(64, 4)
    params = server.rpc_sync().parameter_rrefs()
    params += [rpc.RRef(p) for p in head.parameters()]
    opt = DistributedOptimizer(torch.optim.Adam, params, lr=3e-3)
    x, y = make_data(4096)
    loss_fn = nn.CrossEntropyLoss()
    shuffle = torch.Generator().manual_seed(2)
    steps, elapsed = 0, 0.0
    for epoch in range(1, epochs + 1):
        losses, correct = [], 0
        t0 = time.perf_counter()
        for idx in torch.randperm(x.shape[0], generator=shuffle).split(batch):
            with dist_autograd.context() as ctx:
                logits = head(server.rpc_sync().forward(x[idx]))
                loss = loss_fn(logits, y[idx])
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
            losses.append(loss.item())
            correct += (logits.argmax(dim=1) == y[idx]).sum().item()
        dt = time.perf_counter() - t0
        steps, elapsed = steps + len(losses), elapsed + dt
        # Loss and accuracy over the epoch's batches, as they were trained on.
        print(
            f"epoch {epoch}/{epochs}  loss {sum(losses) / len(losses):.4f}  "
            f"accuracy {correct / x.shape[0]:6.1%}  "
            f"{len(losses) / dt:5.0f} steps/s ({1000 * dt / len(losses):.2f} ms/step)",
            flush=True,
        )
    return steps, elapsed


def summarize(backend: str, steps: int, elapsed: float) -> None:
    """Steps/s, then calls and bytes per peer as each process's agent counts them."""
    print(f"summary: {steps} steps in {elapsed:.2f} s, {steps / elapsed:.0f} steps/s")
    if backend == "TENSORPIPE":
        # Its get_metrics() has thread-pool gauges (agent.*) and no counters.
        print("  per-peer calls and bytes: not reported by TensorPipe")
        return
    metrics = {"trainer": agent_metrics(), "ps": rpc.rpc_sync("ps", agent_metrics)}
    for name, m in metrics.items():
        for peer in ("trainer", "ps"):
            n = {k: int(m[f"rpc_ext.peer.{peer}.{k}"]) for k in
                 ("calls_sent", "calls_served", "bytes_sent", "bytes_received")}
            if any(n.values()):
                print(
                    f"  {name} with {'itself' if peer == name else peer}: "
                    f"{n['calls_sent']} calls sent, "
                    f"{n['calls_served']} served, {n['bytes_sent'] / 1e6:.2f} MB sent, "
                    f"{n['bytes_received'] / 1e6:.2f} MB received"
                )


def worker(rank: int, port: int, backend: str, epochs: int, batch: int) -> None:
    quiet_known_torch_warnings()  # spawned processes do not inherit filters
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(
        "trainer" if rank == 0 else "ps",
        rank=rank,
        world_size=2,
        backend=getattr(rpc.BackendType, backend),
        rpc_backend_options=BACKENDS[backend](num_worker_threads=8, rpc_timeout=60),
    )
    if rank == 0:
        print(f"{backend} up: trainer + ps, torch {torch.__version__}", flush=True)
        summarize(backend, *train(epochs, batch))
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--backend", choices=list(BACKENDS), default="TORCH_RPC_EXT")
    args = parser.parse_args()
    mp.spawn(worker, args=(torch_rpc_ext.free_port(), args.backend, args.epochs, args.batch), nprocs=2)


if __name__ == "__main__":
    main()
