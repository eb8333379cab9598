# SPDX-License-Identifier: BSD-3-Clause
"""Memory of a member that stays while another comes and goes (dynamic group).

`w0` joins and stays. Then, cycle after cycle, a fresh process joins as
`w1` (the same name and rank each time: a new incarnation), makes an RRef on
`w0`, runs calls and a dist autograd step, and either leaves (`--mode
leave`: rpc.shutdown()) or is killed mid-traffic (`--mode kill`: SIGKILL,
declared dead by its lease). `w0`'s RSS is sampled every `--every` cycles
after a gc; the last row gives the growth per cycle: what a long-lived
member pays per departure (docs/reliability.md, "Elastic churn").

  python benchmarks/elastic_memory.py --mode kill --cycles 40
"""

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # a source checkout works without installing
from _harness import emit, rss_mb  # noqa: E402

import torch_rpc_ext  # noqa: E402  (registers TORCH_RPC_EXT)


def _options(path: str):
    return torch_rpc_ext.RpcExtBackendOptions(
        init_method=f"file://{path}", address="127.0.0.1", heartbeat_timeout=2.0,
        rpc_timeout=20)


def _join(name: str, rank: int, path: str) -> None:
    rpc.init_rpc(name, rank=rank, backend=rpc.BackendType.TORCH_RPC_EXT,
                 rpc_backend_options=_options(path))


def echo(x):
    return x


def _stayer(path: str, cycles: int, every: int, ticks, out) -> None:
    _join("w0", 0, path)
    ticks.put("up")
    samples = []
    for i in range(cycles + 1):
        if i % every == 0 or i == cycles:
            gc.collect()
            samples.append((i, round(rss_mb(), 1)))
        if i < cycles:
            ticks.get()
    out.put(samples)
    rpc.shutdown()


def _comer(path: str, mode: str, up) -> None:
    import torch.distributed.autograd as dist_autograd

    _join("w1", 1, path)
    rref = rpc.remote("w0", echo, (torch.ones(3),))
    rref.to_here()
    rounds = 0
    while mode == "kill" or rounds < 5:
        futs = [rpc.rpc_async("w0", echo, (torch.ones(10),)) for _ in range(8)]
        torch.futures.wait_all(futs)
        with dist_autograd.context():
            rpc.rpc_sync("w0", torch.add, (torch.ones(2, requires_grad=True), 1))
        rounds += 1
        if rounds == 2:
            up.set()  # killed from here on, mid-traffic
    del rref
    rpc.shutdown()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["leave", "kill"], default="kill")
    p.add_argument("--cycles", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--out", type=Path)
    cfg = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    path = os.path.join(tempfile.mkdtemp(), "store")
    ticks, out = ctx.Queue(), ctx.Queue()
    stayer = ctx.Process(target=_stayer, args=(path, cfg.cycles, cfg.every, ticks, out))
    stayer.start()
    assert ticks.get(timeout=120) == "up"
    t0 = time.monotonic()
    for _ in range(cfg.cycles):
        up = ctx.Event()
        comer = ctx.Process(target=_comer, args=(path, cfg.mode, up))
        comer.start()
        if cfg.mode == "kill":
            up.wait(120)
            comer.kill()
        comer.join(120)
        ticks.put(1)
    samples = out.get(timeout=300)
    stayer.join(120)
    sink = cfg.out.open("w") if cfg.out else None
    for cycle, mb in samples:
        row = {"mode": cfg.mode, "cycle": cycle, "w0_rss_mb": mb}
        emit(row)
        if sink:
            emit(row, sink)
    # The first cycles warm w0 up (its first connections, dist autograd,
    # pools): the steady cost per cycle is measured after them.
    first, last = samples[0][1], samples[-1][1]
    warm_cycle, warm = samples[min(1, len(samples) - 1)]
    steady = max(cfg.cycles - warm_cycle, 1)
    row = {"mode": cfg.mode, "cycles": cfg.cycles, "w0_rss_first_mb": first,
           f"w0_rss_at_cycle_{warm_cycle}_mb": warm, "w0_rss_last_mb": last,
           "growth_kb_per_cycle_after_warmup": round((last - warm) * 1024 / steady, 1),
           "seconds": round(time.monotonic() - t0, 1)}
    emit(row)
    if sink:
        emit(row, sink)


if __name__ == "__main__":
    main()
