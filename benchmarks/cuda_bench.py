# SPDX-License-Identifier: BSD-3-Clause
"""CUDA RPC on one GPU: TORCH_RPC_EXT and TensorPipe side by side in one run.

Two processes on one host, both on cuda:0, device map {0: 0} (issue 22's
matrix; TensorPipe's own figures on an H100 are in ../shared's
cuda-anchors.md). Every case is a round trip of `rpc_sync` with the device
synchronised before and after each call; rows are medians over the calls
after warm-up:

  identity_4KB .. identity_400MB   one float32 tensor there and back
  many_256x16KB, many_1000x1KB     a list of tensors in one call
  strided_32MB, contiguous_32MB    every other row of a 4096 x 4096 float32
                                   (a 32 MB view of 64 MB), and 32 MB whole
  recipe                           the CUDA RPC recipe: two Linear(1000, 1000)
                                   shards, ten dist-autograd forward and
                                   backward passes (seconds for the ten)
  (ext_zero_copy)                  ours with cuda_zero_copy=True, the cases
                                   above but the recipe: what landing received
                                   tensors in torch's allocator costs
                                   (`time_copy_over_zero_copy`; each of ours
                                   rows has `copies_per_call`, both ends)
  staged_400MB                     ours with device_channels=("cuda_staged",),
                                   beside `pcie_floor_400MB`: one copy of
                                   400 MB to pinned host memory and one back,
                                   timed in the caller (two PCIe copies)

Output: JSON lines, one per (backend, case), then one ratio per case
(`time_ext_over_tp`) and `staged_over_pcie_floor` (a round trip staged
costs two directions: the ratio divides by twice the floor).

  python benchmarks/cuda_bench.py --out cuda.jsonl --chart cuda.png
  python benchmarks/cuda_bench.py --smoke     # small sizes, few calls

--fake runs ours only on the fake driver of tests/cuda_fake (a CPU torch,
TORCH_RPC_EXT_LIBCUDA set, small sizes, no recipe): it proves the script and
the path it drives, not any figure.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # a source checkout works without installing
from _harness import emit, run_world, summarize  # noqa: E402

DEVICE = 0
MB = 1 << 20


def identity(x):
    return x


class Shard(torch.nn.Module):
    """One half of the recipe's model, on `device`."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device
        self.linear = torch.nn.Linear(1000, 1000).to(device)

    def forward(self, x):
        return self.linear(x.to(self.device))


def cases_for(cfg) -> list[tuple[str, str, int]]:
    """(case, kind, size): kind is identity | many | strided | contiguous."""
    if cfg.fake or cfg.smoke:
        sizes = [("4KB", 4 << 10), ("64KB", 64 << 10), ("4MB", 4 * MB)]
    else:
        sizes = [("4KB", 4 << 10), ("64KB", 64 << 10), ("4MB", 4 * MB), ("400MB", 400 * MB)]
    out = [(f"identity_{label}", "identity", n) for label, n in sizes]
    out += [("many_256x16KB", "many", 16 << 10), ("many_1000x1KB", "many", 1 << 10)]
    side = 256 if (cfg.fake or cfg.smoke) else 4096
    half = side * side * 2  # bytes of every other row
    label = f"{half // MB}MB" if half >= MB else f"{half >> 10}KB"
    out += [(f"strided_{label}", "strided", side), (f"contiguous_{label}", "contiguous", side)]
    return out


class Devices:
    """CUDA tensors and synchronisation: torch's own on a GPU; with --fake,
    views of the fake driver's memory that a CPU torch holds as CUDA
    tensors (torch_rpc_ext._testing.cuda, a build with testing on)."""

    def __init__(self, fake: bool):
        self.fake = fake
        self.keep = []
        if fake:
            from torch_rpc_ext import _testing

            self.cu = _testing.cuda
            assert self.cu.install_fake_cuda_guard() == "fake"
            torch.cuda.device_count = lambda: self.cu.device_count()
            torch.cuda.init = self.cu.torch_cuda_init  # the fake allocator's init

    def tensor(self, nbytes: int, shape=None, strides=None, offset: int = 0) -> torch.Tensor:
        shape = list(shape or [nbytes // 4])
        if not self.fake:
            return torch.rand(nbytes // 4, device=f"cuda:{DEVICE}").as_strided(
                shape, strides or torch.empty(shape, device="meta").stride(), offset)
        p = self.cu.mem_alloc(DEVICE, nbytes)
        self.keep.append(p)
        like = torch.empty(0, dtype=torch.float32)
        return self.cu.device_tensor(p + 4 * offset, shape, like, DEVICE, strides)

    def sync(self) -> None:
        if self.fake:
            self.cu.stream_synchronize(DEVICE, self.cu.current_stream(DEVICE))
        else:
            torch.cuda.synchronize(DEVICE)


def _init(rank, backend_key, channels, fake, zero_copy=False) -> Devices:
    import torch_rpc_ext

    dev = Devices(fake)  # the fake guard first, where it applies
    kwargs = dict(init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                  num_worker_threads=16, rpc_timeout=600)
    if backend_key == "TENSORPIPE":
        opts = rpc.TensorPipeRpcBackendOptions(**kwargs)
    else:
        opts = torch_rpc_ext.RpcExtBackendOptions(device_channels=channels,
                                                  cuda_zero_copy=zero_copy, **kwargs)
    if rank == 0:  # the callee answers through the reverse map
        opts.set_device_map("callee", {DEVICE: DEVICE})
    rpc.init_rpc(["caller", "callee"][rank], rank=rank, world_size=2,
                 backend=rpc.BackendType[backend_key], rpc_backend_options=opts)
    return dev


def pcie_floor(dev: Devices, nbytes: int, calls: int) -> float:
    """Median seconds of one device-to-host copy into pinned memory and one
    back: the two copies a staged direction cannot avoid."""
    x = torch.rand(nbytes // 4, device=f"cuda:{DEVICE}")
    host = torch.empty(nbytes // 4, pin_memory=True)
    samples = []
    for _ in range(calls + 1):
        dev.sync()
        t0 = time.perf_counter()
        host.copy_(x, non_blocking=True)
        x.copy_(host, non_blocking=True)
        dev.sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


def device_copies() -> dict[str, int]:
    """This worker's device copies so far: the landings into torch's memory
    (segments, launches) and the channels' launches."""
    m = rpc.api._get_current_rpc_agent().get_metrics()
    keys = {"rpc_ext.cuda.landed_segments": "landed", "rpc_ext.cuda.landing_launches":
            "landing_launches", "rpc_ext.channel.cuda_ipc.launches": "ipc_launches"}
    return {short: int(m.get(k, 0)) for k, short in keys.items()}


def both_copies() -> dict[str, int]:
    """device_copies() of the caller and the callee, summed."""
    mine, theirs = device_copies(), rpc.rpc_sync("callee", device_copies)
    return {k: mine[k] + theirs[k] for k in mine}


def world(rank, world_size, backend_key, channels, cases, cfg):
    dev = _init(rank, backend_key, channels, cfg.fake, cfg.zero_copy)
    rows = []
    if rank == 0:
        for case, kind, size in cases:
            if kind == "identity":
                arg = dev.tensor(size)
            elif kind == "many":
                arg = [dev.tensor(size) for _ in range(256 if size == 16 << 10 else 1000)]
            elif kind == "strided":
                arg = dev.tensor(size * size * 4, [size // 2, size], [2 * size, 1])
            else:
                arg = dev.tensor(size * size * 2)
            calls = cfg.calls if size < 64 * MB else cfg.calls_large
            counted = backend_key == "TORCH_RPC_EXT" and both_copies()
            samples = []
            for i in range(cfg.warmup + calls):
                dev.sync()
                t0 = time.perf_counter()
                out = rpc.rpc_sync("callee", identity, args=(arg,))
                dev.sync()
                if i >= cfg.warmup:
                    samples.append(time.perf_counter() - t0)
                del out
            row = {"case": case, **summarize(samples)}
            if counted:
                # Device copies per round trip, both ends: what landing in
                # torch's memory adds (compare ext_zero_copy's rows).
                after = both_copies()
                row["copies_per_call"] = {
                    k: round((after[k] - counted[k]) / (cfg.warmup + calls), 2)
                    for k in after}
            rows.append(row)
        if cfg.recipe:
            rows.append(recipe(cfg))
        if cfg.staged_floor:
            floor = pcie_floor(dev, 400 * MB, cfg.calls_large)
            rows.append({"case": "pcie_floor_400MB", "median_us": round(floor * 1e6, 1)})
    rpc.shutdown()
    return rows


def recipe(cfg) -> dict:
    """The CUDA RPC recipe on one GPU: a local and a remote shard, ten
    forward and backward passes under dist autograd, timed as a whole."""
    import torch.distributed.autograd as dist_autograd

    local = Shard(f"cuda:{DEVICE}")
    remote = rpc.remote("callee", Shard, args=(f"cuda:{DEVICE}",))
    x = torch.randn(1000, 1000, device=f"cuda:{DEVICE}")
    samples = []
    for _ in range(cfg.recipe_rounds + 1):
        torch.cuda.synchronize(DEVICE)
        t0 = time.perf_counter()
        for _ in range(10):
            with dist_autograd.context() as ctx:
                y = remote.rpc_sync().forward(local(x))
                dist_autograd.backward(ctx, [y.sum()])
        torch.cuda.synchronize(DEVICE)
        samples.append(time.perf_counter() - t0)
    return {"case": "recipe", **summarize(samples[1:])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small sizes, few calls")
    p.add_argument("--fake", action="store_true",
                   help="ours only, on the fake driver (TORCH_RPC_EXT_LIBCUDA): a smoke test")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--calls-large", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--recipe-rounds", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=["ext", "tensorpipe"],
                   choices=["ext", "tensorpipe"])
    p.add_argument("--chart", type=Path, help="write a PNG chart of the ratios (matplotlib)")
    p.add_argument("--out", type=Path)
    cfg = p.parse_args(argv)
    if cfg.fake:
        if not os.environ.get("TORCH_RPC_EXT_LIBCUDA"):
            p.error("--fake needs TORCH_RPC_EXT_LIBCUDA naming the fake driver")
        cfg.backends = ["ext"]
    if cfg.fake or cfg.smoke:
        cfg.calls, cfg.calls_large, cfg.warmup, cfg.recipe_rounds = 5, 2, 1, 1
    out = cfg.out.open("w") if cfg.out else None

    def record(row):
        emit(row)
        if out:
            emit(row, out)

    cases = cases_for(cfg)
    results: dict[tuple[str, str], dict] = {}
    plans = [(name, key, None) for name, key in
             (("ext", "TORCH_RPC_EXT"), ("tensorpipe", "TENSORPIPE")) if name in cfg.backends]
    plans.append(("ext_staged", "TORCH_RPC_EXT", ("cuda_staged",)))
    if "ext" in cfg.backends:
        plans.append(("ext_zero_copy", "TORCH_RPC_EXT", None))
    for name, key, channels in plans:
        cfg.recipe = not cfg.fake and name not in ("ext_staged", "ext_zero_copy")
        cfg.staged_floor = not cfg.fake and name == "ext_staged"
        cfg.zero_copy = name == "ext_zero_copy"
        these = cases
        if name == "ext_staged":
            these = [c for c in cases if c[0] in ("identity_400MB", "identity_4MB")]
        if name == "ext_zero_copy":
            these = [c for c in cases if c[1] != "contiguous"]
        rows, _ = run_world(world, 2, key, channels or ("cuda_ipc", "cuda_staged"), these, cfg,
                            timeout=1800)
        for row in rows:
            row = {"backend": name, **row}
            results[(row["case"], name)] = row
            record(row)
    chart_rows = {}
    for case in sorted({c for c, _ in results}):
        ext, tp = results.get((case, "ext")), results.get((case, "tensorpipe"))
        if ext and tp:
            value = round(ext["median_us"] / tp["median_us"], 3)
            chart_rows[case] = value
            record({"case": case, "ratio": "time_ext_over_tp", "value": value})
    for case in sorted({c for c, _ in results}):
        ext, zero = results.get((case, "ext")), results.get((case, "ext_zero_copy"))
        if ext and zero:
            record({"case": case, "ratio": "time_copy_over_zero_copy",
                    "value": round(ext["median_us"] / zero["median_us"], 3)})
    staged = results.get(("identity_400MB", "ext_staged"))
    floor = results.get(("pcie_floor_400MB", "ext_staged"))
    if staged and floor:
        record({"case": "staged_400MB", "ratio": "staged_over_pcie_floor",
                "value": round(staged["median_us"] / (2 * floor["median_us"]), 3)})
    if cfg.chart and chart_rows:
        try:
            chart(chart_rows, cfg.chart)
        except ImportError as e:  # the figures stand without the picture
            print(f"cuda_bench: no chart ({e})", file=sys.stderr)


def chart(ratios: dict[str, float], path: Path) -> None:
    """Bar chart: time on TORCH_RPC_EXT / time on TensorPipe, per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted(ratios)
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(cases) + 1.5))
    ax.barh(cases, [ratios[c] for c in cases])
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_xlabel("time, TORCH_RPC_EXT / TensorPipe (lower is better)")
    ax.set_title("CUDA RPC, two processes on one GPU, map {0: 0}")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
