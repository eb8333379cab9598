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
  cpu_4KB                          a CPU tensor between the same workers
  cpu_1000x1KB                     1000 CPU tensors of 1 KB in one call between
                                   them: the part of many_1000x1KB that is no
                                   device's (pickling, Python objects, framing)
  recipe                           the CUDA RPC recipe: two Linear(1000, 1000)
                                   shards, ten dist-autograd forward and
                                   backward passes (seconds for the ten)
  (ext_zero_copy)                  ours with cuda_zero_copy=True, the cases
                                   above but the recipe: what landing received
                                   tensors in torch's allocator costs
                                   (`time_copy_over_zero_copy`)
  (ext_grants)                     ours with the landing pool and its grants
                                   (TORCH_RPC_EXT_CUDA_LANDING_POOL=1; torch
                                   2.13 or newer on a GPU), the identity and
                                   contiguous cases: a large segment written
                                   by the sender straight into landing memory
                                   the receiver granted (`time_grants_over_copy`)

Each of ours rows has `costs_per_call`: what one round trip costs after
warm-up, both ends, less the harness's own syncs: device copies (`landed`,
`landing_launches`, `landing_allocations`, `ipc_launches`), frames and control frames sent, socket
reads and writes, loop wake-ups, torch's allocations (on the fake also
`pool_windows`: routings to a landing pool), and on the fake driver
every driver call by entry point and grouped (allocations, launches,
memcpys, stream waits, event records/queries/creates, context get/set calls,
host waits). tests/cuda_driver/test_cuda_bench.py holds budgets for them.
  staged_400MB                     ours with device_channels=("cuda_staged",),
                                   beside `pcie_floor_400MB`: one copy of
                                   400 MB to pinned host memory and one back,
                                   timed in the caller (two PCIe copies)
  ring_400MB                       the same with ("cuda_ring", "cuda_staged"):
                                   staging through a shared pinned ring, no
                                   socket (what one host uses where cuda_ipc
                                   cannot join the devices)
  ext_tls_stream, ext_tls_lanes    identity 4 MB and 400 MB as between hosts:
                                   TCP with TLS, cuda_staged copying out, the
                                   bytes through the connection's stream or
                                   over tcp_lanes (`tls_lanes_over_stream`)

Output: JSON lines, one per (backend, case), then one ratio per case
(`time_ext_over_tp`), `cuda_over_cpu` (many_1000x1KB over cpu_1000x1KB,
per backend), `staged_over_ipc` (identity_4KB through cuda_staged over
cuda_ipc), `staged_over_pcie_floor` and `ring_over_pcie_floor`
(a round trip staged costs two directions: the ratio divides by twice the
floor).

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


def _noop():
    return None


def dial_back():
    """Run on the callee: a call of its own to the caller, so that its
    connection to the caller is up before any window. The callee waits in
    rpc.shutdown(), whose watch probes the caller every second over that
    connection (docs/reliability.md); made there, it was made inside some
    case's window, on a loaded host: its setup frames and its channels'
    device queries counted as that case's."""
    rpc.rpc_sync("caller", _noop)


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
    """(case, kind, size): kind is identity | many | strided | contiguous |
    cpu | self."""
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
    # A CPU tensor between the same two workers (their device maps on): what
    # a CPU-only call costs on the GPU side, beside the CUDA cases.
    out += [("cpu_4KB", "cpu", 4 << 10)]
    # Its many-tensor twin: what 1000 tensors cost a call with no device in
    # it (torch's pickling, the tensors' Python objects, our framing), the
    # floor under many_1000x1KB.
    out += [("cpu_1000x1KB", "cpu_many", 1 << 10)]
    # The caller to itself (cuda_self; TensorPipe's cuda_xth).
    out += [("self_4MB", "self", 4 * MB)]
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
            if self.cu.install_fake_cuda_guard() != "fake":
                raise SystemExit(
                    f"cuda_bench.py --fake: torch {torch.__version__} is a CUDA build; the fake "
                    "driver's tensors need a CPU torch (its device guard is torch's own here)")
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
        if isinstance(channels, dict):  # options of the plan's own
            kwargs.update(channels)
        elif channels:  # else the options' default
            kwargs["device_channels"] = channels
        opts = torch_rpc_ext.RpcExtBackendOptions(cuda_zero_copy=zero_copy, **kwargs)
    if rank == 0:  # the callee answers through the reverse map
        opts.set_device_map("callee", {DEVICE: DEVICE})
        opts.set_device_map("caller", {DEVICE: DEVICE})  # the self case
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
            "landing_launches", "rpc_ext.cuda.landing_allocations": "landing_allocations",
            "rpc_ext.channel.cuda_ipc.launches": "ipc_launches",
            "rpc_ext.channel.cuda_ipc.grants_used": "grants_used"}
    return {short: int(m.get(k, 0)) for k, short in keys.items()}


# What a message costs, from the agent's transports (every backend's
# counters summed: shm and tcp) ...
WIRE = {"frames_sent": "frames", "control_frames_sent": "control_frames",
        "socket_writes": "socket_writes", "socket_reads": "socket_reads",
        "socket_bytes_written": "socket_bytes",
        # shm connections' frames go through their frame rings instead of
        # the socket (shm_frame_ring_bytes): what a message puts in the
        # connection's stream is socket_bytes + frame_ring_bytes.
        "frame_ring_writes": "frame_ring_writes",
        "frame_ring_bytes_written": "frame_ring_bytes",
        "loop_wakes": "loop_wakes"}
# ... connections made and lost (each peer's counters, summed: a healthy
# pair makes none in a window) ...
PEER = {"dials": "dials", "accepted": "accepted", "connections_lost": "connections_lost"}
# ... and, on the fake driver, in driver calls, grouped by what they do.
DRIVER_GROUPS = {
    "allocations": ("cuMemAlloc_v2", "cuMemCreate", "cuMemHostAlloc"),
    "frees": ("cuMemFree_v2", "cuMemRelease", "cuMemFreeHost"),
    "launches": ("cuLaunchKernel",),
    "memcpys": ("cuMemcpyAsync", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2",
                "cuMemcpyDtoDAsync_v2", "cuMemcpy2DAsync_v2"),
    "stream_waits": ("cuStreamWaitEvent",),
    "event_records": ("cuEventRecord",),
    "event_queries": ("cuEventQuery",),
    "event_creates": ("cuEventCreate",),
    "context_calls": ("cuCtxSetCurrent", "cuCtxGetCurrent"),
    "host_waits": ("cuStreamSynchronize", "cuEventSynchronize"),
}


def fake_driver_stats() -> dict | None:
    """The fake driver's counters (tests/cuda_fake), None on a real one."""
    import ctypes
    import json

    path = os.environ.get("TORCH_RPC_EXT_LIBCUDA")
    if not path:
        return None
    lib = ctypes.CDLL(path)  # the library the extension loaded: one state
    if not hasattr(lib, "fake_cuda_stats"):
        return None
    buf = ctypes.create_string_buffer(1 << 17)
    n = lib.fake_cuda_stats(buf, len(buf))
    return json.loads(buf.raw[:n])


def costs() -> dict[str, int]:
    """This worker's running totals of what messages cost: frames, system
    calls and wake-ups (any driver); on the fake driver, every driver call
    by entry point (`cu*` keys) and torch's allocations (the fake caching
    allocator's blocks made); on a GPU, torch's cudaMalloc segments."""
    out = {short: 0 for short in (*WIRE.values(), *PEER.values())}
    for key, value in rpc.api._get_current_rpc_agent().get_metrics().items():
        counter = key.rsplit(".", 1)[-1]
        if counter in WIRE and key.count(".") == 2:  # rpc_ext.<transport>.<counter>
            out[WIRE[counter]] += int(value)
        elif counter in PEER and key.startswith("rpc_ext.peer."):
            out[PEER[counter]] += int(value)
    out.update(device_copies())
    stats = fake_driver_stats()
    if stats is not None:
        out.update(stats["calls"])
        # "from:<library>:<entry point>": the calls by the library holding
        # the call site (_C, _testing; see summarize_costs).
        out.update({"from:" + k: v for k, v in stats.get("calls_from", {}).items()})
        from torch_rpc_ext import _testing

        allocator = _testing.cuda.allocator_stats()
        out["torch_allocations"] = allocator["allocated"]
        out["pool_windows"] = allocator["windows"]
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_allocations"] = torch.cuda.memory_stats(DEVICE).get(
            "segment.all.allocated", 0)
    return out


def both_costs() -> tuple[dict[str, int], dict[str, int]]:
    """costs() of the callee, then of the caller (in that order, so that the
    caller's window holds none of this call's own frames)."""
    theirs = rpc.rpc_sync("callee", costs)
    return costs(), theirs


def window(before, after) -> tuple[dict[str, int], dict[str, int]]:
    """What each end (caller, callee) counted between two both_costs()."""
    return tuple({k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}
                 for a, b in zip(after, before))


def harness_cost(dev: Devices, calls: int) -> tuple:
    """What a window costs each end with no RPC in it: once (the counting
    calls at its ends) and per call (the two syncs around each)."""
    empty = window(both_costs(), both_costs())
    before = both_costs()
    for _ in range(calls):
        dev.sync()
        dev.sync()
    synced = window(before, both_costs())
    each = tuple({k: (s.get(k, 0) - e.get(k, 0)) / calls for k in s}
                 for s, e in zip(synced, empty))
    return empty, each


def summarize_costs(delta: tuple, calls: int, harness: tuple) -> dict:
    """Per round trip, both ends summed, less the harness's own share
    (`harness`: harness_cost()): the groups of DRIVER_GROUPS, the wire
    counters, and every driver entry point that moved, per end."""
    once, each = harness
    ends = [{k: round((d.get(k, 0) - o.get(k, 0)) / calls - e.get(k, 0), 2) for k in d}
            for d, o, e in zip(delta, once, each)]
    net = {k: round(sum(end.get(k, 0) for end in ends), 2) for end in ends for k in end}
    out = {short: net.get(short, 0) for short in (*WIRE.values(), *PEER.values())}
    out["torch_allocations"] = net.get("torch_allocations", 0)
    if "pool_windows" in net:  # the fake's: routings to a landing pool
        out["pool_windows"] = net["pool_windows"]
    for k in ("landed", "landing_launches", "landing_allocations", "ipc_launches",
              "grants_used"):
        out[k] = net.get(k, 0)
    if any(k.startswith("cu") for k in net):  # the fake driver's counts
        driver = {k: v for k, v in net.items() if k.startswith("cu") and v}
        for group, names in DRIVER_GROUPS.items():
            out[group] = round(sum(driver.get(n, 0) for n in names), 2)
        out["allocations"] = round(out["allocations"] + out["torch_allocations"], 2)
        out["driver_calls"] = round(sum(driver.values()), 2)
        # Where they were made, both ends summed: in _C (torch_rpc_ext, and
        # the device guard the fake's stand-in for torch borrows from it:
        # context and capture-mode calls) or in _testing (the stand-in's
        # events, streams and memory: what torch's futures, guards and
        # caching allocator would call).
        from_ = {k[5:]: v for k, v in net.items() if k.startswith("from:") and v}
        out["driver_calls_by_library"] = {
            lib: round(sum(v for k, v in from_.items() if k.split(":")[0] == lib), 2)
            for lib in sorted({k.split(":")[0] for k in from_})}
        out["driver_from"] = dict(sorted(from_.items()))
        out["driver"] = {
            end: dict(sorted((k, v) for k, v in counts.items() if k.startswith("cu") and v))
            for end, counts in zip(("caller", "callee"), ends)}
    return out


def grants_here(fake: bool) -> bool:
    """Whether the ext_grants plan runs: on the fake always; on a GPU where
    torch can hold the landing pool (2.13 or newer: landing_pool.check_torch),
    else it says why it is left out."""
    if fake:
        return True
    from torch_rpc_ext._cuda import landing_pool

    try:
        landing_pool.check_torch(torch.__version__, torch.cuda.get_allocator_backend())
    except RuntimeError as e:
        print(f"cuda_bench: ext_grants left out: {e}", file=sys.stderr, flush=True)
        return False
    return True


def lanes_opened() -> int:
    """This process's tcp_lanes opened, dialled and accepted (8 once a
    connection's lanes are up both ways)."""
    m = rpc.api._get_current_rpc_agent().get_metrics()
    return int(m.get("rpc_ext.channel.tcp_lanes.lanes_opened", 0))


def await_lanes(arg, limit_s: float = 30.0) -> None:
    """Calls the callee with `arg` (a large segment dials a side's lanes)
    until both sides' lanes are up, `limit_s` at most."""
    deadline = time.monotonic() + limit_s
    while (min(lanes_opened(), rpc.rpc_sync("callee", lanes_opened)) < 8
           and time.monotonic() < deadline):
        rpc.rpc_sync("callee", identity, args=(arg,))
        time.sleep(0.01)


def world(rank, world_size, backend_key, channels, cases, cfg):
    # Read by init_rpc: the plan's, not the caller's environment.
    os.environ["TORCH_RPC_EXT_CUDA_LANDING_POOL"] = "1" if cfg.grants else "0"
    dev = _init(rank, backend_key, channels, cfg.fake, cfg.zero_copy)
    rows = []
    if rank == 0:
        rpc.rpc_sync("callee", dial_back)
        ours = backend_key == "TORCH_RPC_EXT"
        lanes = isinstance(channels, dict) and "tcp_lanes" in channels.get("channels", ())
        for case, kind, size in cases:
            if kind == "identity":
                arg = dev.tensor(size)
            elif kind == "many":
                arg = [dev.tensor(size) for _ in range(256 if size == 16 << 10 else 1000)]
            elif kind == "cpu":
                arg = torch.rand(size // 4)
            elif kind == "cpu_many":
                arg = [torch.rand(size // 4) for _ in range(1000)]
            elif kind == "self":
                arg = dev.tensor(size)
            elif kind == "strided":
                arg = dev.tensor(size * size * 4, [size // 2, size], [2 * size, 1])
            else:
                arg = dev.tensor(size * size * 2)
            calls = cfg.calls if size < 64 * MB else cfg.calls_large
            samples = []
            for i in range(cfg.warmup + calls):
                if i == cfg.warmup and lanes:
                    # The window is the lanes' steady state: each side's
                    # four up, however late a loaded host dialled them.
                    await_lanes(arg)
                if ours and i == cfg.warmup:
                    # After warm-up: the steady state, less what the window
                    # itself costs on this warm connection.
                    harness = harness_cost(dev, calls)
                    before = both_costs()
                dev.sync()
                t0 = time.perf_counter()
                out = rpc.rpc_sync("caller" if kind == "self" else "callee", identity,
                                   args=(arg,))
                dev.sync()
                if i >= cfg.warmup:
                    samples.append(time.perf_counter() - t0)
                del out
            row = {"case": case, **summarize(samples)}
            if ours:
                # What one round trip costs, both ends, after warm-up:
                # device copies (compare ext_zero_copy's rows), frames,
                # system calls, wake-ups, and on the fake every driver call.
                row["costs_per_call"] = summarize_costs(
                    window(before, both_costs()), calls, harness)
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
    forward and backward passes under dist autograd, timed as a whole.

    Then its parts, in rounds of their own with the device synchronised
    between them (so they do not add up to the whole exactly), medians of
    one pass in us (`phases_us`): `forward` (the local shard and the call
    to the remote one), `backward` (dist autograd's backward, its call to
    the remote shard's backward and the gradient's way back), and
    `local_only` (both shards' forward and backward in this process, no
    RPC: the compute that is the same on every backend, under the ratio).
    """
    import torch.distributed.autograd as dist_autograd

    device = f"cuda:{DEVICE}"

    def sync():
        torch.cuda.synchronize(device)

    local = Shard(device)
    remote = rpc.remote("callee", Shard, args=(device,))
    x = torch.randn(1000, 1000, device=device)
    samples = []
    for _ in range(cfg.recipe_rounds + 1):
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            with dist_autograd.context() as ctx:
                y = remote.rpc_sync().forward(local(x))
                dist_autograd.backward(ctx, [y.sum()])
        sync()
        samples.append(time.perf_counter() - t0)
    phases = {"forward": [], "backward": [], "local_only": []}
    other = Shard(device)  # the remote shard's twin, here
    for i in range(10 * cfg.recipe_rounds + 2):
        with dist_autograd.context() as ctx:
            sync()
            t0 = time.perf_counter()
            y = remote.rpc_sync().forward(local(x))
            sync()
            t1 = time.perf_counter()
            dist_autograd.backward(ctx, [y.sum()])
            sync()
            t2 = time.perf_counter()
        # (Timed from here: leaving the context sends its release.)
        sync()
        t2b = time.perf_counter()
        other(local(x)).sum().backward()
        sync()
        t3 = time.perf_counter()
        local.zero_grad()
        other.zero_grad()
        if i >= 2:  # less two warm-up passes
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["local_only"].append(t3 - t2b)
    return {"case": "recipe", **summarize(samples[1:]),
            "phases_us": {k: summarize(v)["median_us"] for k, v in phases.items()}}


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
    p.add_argument("--cases", nargs="+", metavar="CASE",
                   help="only these cases (e.g. identity_4KB many_1000x1KB)")
    p.add_argument("--main-plans-only", action="store_true",
                   help="ours and TensorPipe only: no staged, ring or zero-copy plans "
                        "(tools/gpu_check.sh's run under MPS)")
    p.add_argument("--plans", nargs="+", metavar="PLAN",
                   help="only these backends (ext, tensorpipe, ext_staged, ext_ring, "
                   "ext_tls_stream, ext_tls_lanes, ext_zero_copy, ext_grants)")
    p.add_argument("--chart", type=Path, help="write a PNG chart of the ratios (matplotlib)")
    p.add_argument("--out", type=Path)
    cfg = p.parse_args(argv)
    if cfg.fake:
        if not os.environ.get("TORCH_RPC_EXT_LIBCUDA"):
            p.error("--fake needs TORCH_RPC_EXT_LIBCUDA naming the fake driver")
        cfg.backends = ["ext"]
    if cfg.fake or cfg.smoke:
        # Four warm-up calls: a block freed while a peer's stream still uses
        # it is reused only once that stream passed the free, so torch's
        # cache can need a second block of a size before its steady state
        # (two warm-up calls left that to the counted window once, in CI on
        # a loaded machine, after the fake's waits became exact: session 47).
        cfg.calls, cfg.calls_large, cfg.warmup, cfg.recipe_rounds = 5, 2, 4, 1
    out = cfg.out.open("w") if cfg.out else None

    def record(row):
        emit(row)
        if out:
            emit(row, out)

    cases = cases_for(cfg)
    if cfg.cases:
        unknown = set(cfg.cases) - {c[0] for c in cases}
        if unknown:
            p.error(f"unknown cases {sorted(unknown)}: {[c[0] for c in cases]}")
        cases = [c for c in cases if c[0] in cfg.cases]
    results: dict[tuple[str, str], dict] = {}
    plans = [(name, key, None) for name, key in
             (("ext", "TORCH_RPC_EXT"), ("tensorpipe", "TENSORPIPE")) if name in cfg.backends]
    if not cfg.main_plans_only:
        plans.append(("ext_staged", "TORCH_RPC_EXT", ("cuda_staged",)))
        plans.append(("ext_ring", "TORCH_RPC_EXT", ("cuda_ring", "cuda_staged")))
        # As between hosts: TCP with TLS, cuda_staged, its bytes through the
        # connection's stream or over the lanes (the default there).
        across = dict(device_channels=("cuda_staged",), transports=("tcp",),
                      encryption="always")
        plans.append(("ext_tls_stream", "TORCH_RPC_EXT", {**across, "channels": ()}))
        plans.append(("ext_tls_lanes", "TORCH_RPC_EXT",
                      {**across, "channels": ("tcp_lanes",)}))
    if "ext" in cfg.backends and not cfg.main_plans_only:
        plans.append(("ext_zero_copy", "TORCH_RPC_EXT", None))
        if grants_here(cfg.fake):
            plans.append(("ext_grants", "TORCH_RPC_EXT", None))
    if cfg.plans:
        unknown = set(cfg.plans) - {name for name, _, _ in plans}
        if unknown:
            p.error(f"unknown plans {sorted(unknown)}: {[name for name, _, _ in plans]}")
        plans = [plan for plan in plans if plan[0] in cfg.plans]
    for name, key, channels in plans:
        staging = ("ext_staged", "ext_ring", "ext_tls_stream", "ext_tls_lanes")
        cfg.recipe = not cfg.fake and name not in (*staging, "ext_zero_copy")
        cfg.staged_floor = not cfg.fake and name in ("ext_staged", "ext_ring")
        cfg.zero_copy = name == "ext_zero_copy"
        cfg.grants = name == "ext_grants"
        these = cases
        if name in staging:
            big = ("identity_400MB", "identity_4MB")
            # A small tensor staged through pinned host memory beside
            # cuda_ipc's (`staged_over_ipc`): whether two processes on one
            # GPU pay the contexts' time-slicing there too.
            these = [c for c in cases
                     if c[0] in big or (name == "ext_staged" and c[0] == "identity_4KB")]
        if name == "ext_zero_copy":
            these = [c for c in cases if c[1] not in ("contiguous", "cpu", "cpu_many")]
        if name == "ext_grants":
            these = [c for c in cases if c[0].startswith(("identity_", "contiguous_"))]
        if not these:
            continue
        print(f"cuda_bench: {name}: {[c[0] for c in these]}", file=sys.stderr, flush=True)
        # A real driver's workers are spawned (_harness.start_world).
        rows, _ = run_world(world, 2, key, channels, these, cfg,
                            timeout=1800, start=None if cfg.fake else "spawn")
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
    for case in sorted({c for c, _ in results}):
        ext, grants = results.get((case, "ext")), results.get((case, "ext_grants"))
        if ext and grants:
            record({"case": case, "ratio": "time_grants_over_copy",
                    "value": round(grants["median_us"] / ext["median_us"], 3)})
    for plan, case, ratio in (("ext_staged", "staged_400MB", "staged_over_pcie_floor"),
                              ("ext_ring", "ring_400MB", "ring_over_pcie_floor")):
        staged = results.get(("identity_400MB", plan))
        floor = results.get(("pcie_floor_400MB", plan))
        if staged and floor:
            record({"case": case, "ratio": ratio,
                    "value": round(staged["median_us"] / (2 * floor["median_us"]), 3)})
    staged, ipc = results.get(("identity_4KB", "ext_staged")), results.get(("identity_4KB", "ext"))
    if staged and ipc:
        record({"case": "identity_4KB", "ratio": "staged_over_ipc",
                "value": round(staged["median_us"] / ipc["median_us"], 3)})
    # What the device adds to 1000 tensors in one call, over the same call
    # with CPU tensors between the same workers (1.0: nothing).
    for name in ("ext", "tensorpipe"):
        dev_many, cpu_many = (results.get((c, name)) for c in ("many_1000x1KB", "cpu_1000x1KB"))
        if dev_many and cpu_many:
            record({"case": f"many_1000x1KB_{name}", "ratio": "cuda_over_cpu",
                    "value": round(dev_many["median_us"] / cpu_many["median_us"], 3)})
    for case in ("identity_4MB", "identity_400MB"):
        lanes, stream = results.get((case, "ext_tls_lanes")), results.get((case, "ext_tls_stream"))
        if lanes and stream:
            record({"case": case, "ratio": "tls_lanes_over_stream",
                    "value": round(lanes["median_us"] / stream["median_us"], 3)})
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
