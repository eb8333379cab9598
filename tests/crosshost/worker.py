# SPDX-License-Identifier: BSD-3-Clause
"""One worker of tests/crosshost/test_smoke.py, run inside a namespace host.

usage: python -m tests.crosshost.worker RANK WORLD_SIZE MASTER PORT ADDRESS [OPTIONS]

Rendezvous is tcp://MASTER:PORT; the agent listens on ADDRESS (this host's
address). OPTIONS is a JSON object passed on to RpcExtBackendOptions over
the test defaults below, e.g. '{"rpc_timeout": 30}' or, once the agent has
them, '{"encryption": "always", "tls_cert": ...}'. Run as a module (not as a
file) so that the functions below pickle as tests.crosshost.worker.<name>.

Rank 0 drives the calls of the public API across the two hosts and prints one
line ``RESULT <json>`` with what came back; the other ranks serve, and print
``RESULT <json>`` with their timings after a clean shutdown.
"""

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn
from torch.distributed import rpc
from torch.distributed.nn.api.remote_module import RemoteModule

import torch_rpc_ext


def where_am_i(x):
    """Who ran this, in which network namespace (host)."""
    return {"name": rpc.get_worker_info().name,
            "netns": os.readlink("/proc/self/ns/net"), "value": x * 2}


def scaled_sum(t, k):
    return (t * k).sum()


def debug_info():
    return rpc.api._get_current_rpc_agent().get_debug_info()


def talk_to_all(world_size):
    """Call every other worker once (so that each pair has a connection),
    then return this worker's transport per peer."""
    me = rpc.get_worker_info().name
    for r in range(world_size):
        if f"worker{r}" != me:
            rpc.rpc_sync(f"worker{r}", torch.add, args=(torch.ones(1), r))
    return {k: v for k, v in debug_info().items()
            if k.startswith("rpc_ext.peer.") and k.endswith((".transport", ".security"))}


def drive(world_size):
    out = {"netns": os.readlink("/proc/self/ns/net")}
    t0 = time.monotonic()
    x, y = torch.ones(2, 3), torch.full((2, 3), 2.0)
    # A builtin and a Python function on the other host, one on this host.
    out["builtin"] = rpc.rpc_sync("worker2", torch.add, args=(x, y)).tolist()
    out["python_remote"] = rpc.rpc_sync("worker2", where_am_i, args=(21,))
    out["python_local"] = rpc.rpc_sync("worker1", where_am_i, args=(5,))
    # An RRef owned on the other host.
    rref = rpc.remote("worker3", torch.mul, args=(x, y))
    out["rref_owner"] = rref.owner().name
    out["rref"] = rref.to_here().tolist()
    # Distributed autograd through both workers of the other host:
    # loss = 3 * sum(w * w), so the gradient is 6 w.
    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    with dist_autograd.context() as ctx:
        squared = rpc.rpc_sync("worker2", torch.mul, args=(w, w))
        loss = rpc.rpc_sync("worker3", scaled_sum, args=(squared, 3.0))
        dist_autograd.backward(ctx, [loss])
        grads = dist_autograd.get_gradients(ctx)
        out["grad_count"] = len(grads)
        out["grad"] = grads[w].tolist() if w in grads else None
    out["grad_expected"] = (6 * w.detach()).tolist()
    # A RemoteModule on the other host, checked against its own parameters.
    linear = RemoteModule("worker2/cpu", nn.Linear, args=(4, 2))
    inp = torch.randn(5, 4)
    got = linear.forward(inp)
    weight, bias = (p.to_here() for p in linear.remote_parameters())
    out["remote_module_owner"] = linear.module_rref.owner().name
    out["remote_module_max_error"] = (got - F.linear(inp, weight, bias)).abs().max().item()
    out["calls_s"] = time.monotonic() - t0
    # Every pair connects; then each worker says which transport it uses
    # for each peer, and worker0 gives all its per-peer debug keys.
    out["transports"] = {"worker0": talk_to_all(world_size)}
    for r in range(1, world_size):
        out["transports"][f"worker{r}"] = rpc.rpc_sync(f"worker{r}", talk_to_all,
                                                       args=(world_size,))
    out["peer_info"] = {k: v for k, v in debug_info().items() if k.startswith("rpc_ext.peer.")}
    out["address"] = debug_info().get("rpc_ext.address")
    return out


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    master, port, address = sys.argv[3], sys.argv[4], sys.argv[5]
    extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    host = f"[{master}]" if ":" in master else master
    options = {"init_method": f"tcp://{host}:{port}", "address": address,
               "rpc_timeout": 120, "num_worker_threads": 4, **extra}
    out = {"rank": rank}
    try:
        t0 = time.monotonic()
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     backend=rpc.BackendType.TORCH_RPC_EXT,
                     rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(**options))
        out["init_s"] = time.monotonic() - t0
        if rank == 0:
            out.update(drive(world_size))
        t0 = time.monotonic()
        rpc.shutdown()
        out["shutdown_s"] = time.monotonic() - t0
    except BaseException:
        out["error"] = traceback.format_exc()
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(1)  # no graceful shutdown to wait for
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
