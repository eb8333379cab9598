# SPDX-License-Identifier: BSD-3-Clause
"""Two RPC workers moving CUDA tensors over TORCH_RPC_EXT, each in a
spawned process that loads the driver under test (worker.py says why).

With a CUDA torch (a GPU machine) the tensors are torch's own. With the CPU
torch of CI they are views of the fake driver's device memory
(_testing.cuda.device_tensor) and c10 reaches streams and events through
the fake CUDA device guard (_testing.cuda.install_fake_cuda_guard): torch
holds them, pickles them into messages and hands them to the agent, which
moves them through cuda_ipc exactly as on a GPU; only kernels on them are
out of reach, so the functions below move bytes and read them back, and
never compute."""

import faulthandler
import importlib.util
import os
import random
import sys
import time

import torch
from torch.distributed import rpc

import torch_rpc_ext
from tests.cuda_driver.worker import fake_stats

DEVICE = 0
TIMEOUT = 60
MANY = 20  # small tensors in one call
MANY_BYTES = sum(1000 + i for i in range(MANY))


def cu():
    from torch_rpc_ext import _testing

    return _testing.cuda


def real_cuda() -> bool:
    return torch.cuda.is_available()


# A worker still running after this many seconds is taken as hung: it
# prints every thread's Python stack to stderr (pytest shows it with the
# test's failure) and exits 1, so that the test fails naming it rather than
# waiting out its own limit.
WATCHDOG_S = float(os.environ.get("TORCH_RPC_EXT_TEST_WATCHDOG_S", "150"))


def setup_torch() -> None:
    """A CPU torch gets the fake guard, and a device count that agrees
    with the driver (init validates device maps against it). Starts the
    watchdog (WATCHDOG_S) and the crash reports."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    # A crash prints every thread's stack, native (torch's fatal signal
    # handler) after Python's (faulthandler's, which then chains to it).
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    faulthandler.enable()
    if real_cuda():
        return
    assert cu().install_fake_cuda_guard() == "fake"
    torch.cuda.device_count = lambda: cu().device_count()
    # torch's lazy CUDA init, as far as the fake allocator goes: it refuses
    # to allocate until this has run, as torch's does.
    torch.cuda.init = cu().torch_cuda_init
    from torch_rpc_ext import _torch_private

    if _torch_private.VALIDATES_DEVICES_BY_ACCELERATOR:
        # A CPU torch has no accelerator; the fake devices are CUDA's.
        torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cuda")


_KEEP = []  # device memory behind fake-torch tensors: lives with the process


def cuda_tensor(data: bytes) -> torch.Tensor:
    host = torch.tensor(list(data), dtype=torch.uint8)
    if real_cuda():
        return host.to(f"cuda:{DEVICE}")
    p = cu().mem_alloc(DEVICE, max(len(data), 1))
    if data:
        cu().write(DEVICE, p, data)
    _KEEP.append(p)
    return cu().device_tensor(p, [len(data)], host, DEVICE)


def cuda_view(data: bytes, shape, index) -> tuple[torch.Tensor, bytes]:
    """A float32 CUDA tensor of `shape` holding `data`, viewed through
    `index`; and the bytes of that view, packed in row-major order."""
    host = torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)
    want = host[index]
    if real_cuda():
        return host.to(f"cuda:{DEVICE}")[index], want.contiguous().numpy().tobytes()
    p = cu().mem_alloc(DEVICE, len(data))
    cu().write(DEVICE, p, data)
    _KEEP.append(p)
    # The CPU torch cannot slice a CUDA tensor (no CUDA as_strided): the
    # view is made as the slice would make it.
    view = cu().device_tensor(p + want.storage_offset() * 4, list(want.shape), host, DEVICE,
                              list(want.stride()))
    return view, want.contiguous().numpy().tobytes()


def tensor_bytes(t: torch.Tensor) -> bytes:
    if real_cuda():
        return t.cpu().numpy().tobytes()
    return cu().tensor_bytes(t)


# ---- run on the callee -------------------------------------------------------


def identity(t):
    return t


def describe(t):
    return str(t.device), tensor_bytes(t)


def layout(t):
    return str(t.device), tuple(t.shape), t.stride(), tensor_bytes(t)


def echo_with_storages(ts):
    """The tensors back, and how they lay in storages as received: the
    number of distinct ones and each tensor's storage offset in bytes."""
    ptrs = {t.untyped_storage().data_ptr() for t in ts}
    return ts, (len(ptrs), [t.storage_offset() * t.element_size() for t in ts])


def channel_counters(channel: str = "cuda_ipc") -> dict[str, int]:
    metrics = rpc.api._get_current_rpc_agent().get_metrics()
    prefix = f"rpc_ext.channel.{channel}."
    return {k[len(prefix):]: int(v) for k, v in metrics.items() if k.startswith(prefix)}


# ---- the workers -------------------------------------------------------------


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 13 + seed) % 251 for i in range(n))


def join_pair(rank: int, port: int, target: int | None = DEVICE, both: bool = False,
              **options) -> None:
    """Joins a group of two as worker<rank>: worker0 maps its cuda:0 to
    worker1's cuda:<target> (worker1 answers through the reverse map and
    needs none of its own) and, with `both`, worker1 maps back as well;
    `options`: RpcExtBackendOptions' others."""
    setup_torch()
    opts = torch_rpc_ext.RpcExtBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", address="127.0.0.1",
        num_worker_threads=4, rpc_timeout=TIMEOUT, **options)
    if rank == 0 or both:
        opts.set_device_map(f"worker{1 - rank}", {DEVICE: target if rank == 0 else DEVICE})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)


def run(rank: int, port: int, ctl, channels=("cuda_ipc",), target: int = DEVICE,
        transports=None) -> None:
    """`channels`: the device channels both use; `target`: the device of
    worker1's that worker0's cuda:0 maps to."""
    join_pair(rank, port, target, device_channels=channels, transports=transports)
    out = {}
    agent = rpc.api._get_current_rpc_agent()
    out["devices"] = [str(d) for d in agent._get_devices()]
    out["map"] = {str(k): str(v) for k, v in
                  agent._get_device_map(agent.get_worker_info(f"worker{1 - rank}")).items()}
    if rank == 0:
        data = pattern(3 << 20, 1)
        t = cuda_tensor(data)
        out["seen_by_callee"] = rpc.rpc_sync("worker1", describe, args=(t,)) == (
            f"cuda:{target}", data)
        back = rpc.rpc_sync("worker1", identity, args=(t,))
        out["back"] = (str(back.device), tensor_bytes(back) == data)
        # An empty one has no bytes to carry: it rides in the stream.
        out["empty"] = rpc.rpc_sync("worker1", describe, args=(cuda_tensor(b""),))
        small = pattern(100, 2)
        got = rpc.rpc_async("worker1", identity, args=(cuda_tensor(small),)).wait()
        out["small"] = tensor_bytes(got) == small
        # Many small tensors in one call: packed together (cuda_ipc) or
        # gathered (cuda_staged), one launch each way.
        many = [pattern(1000 + i, i) for i in range(MANY)]
        # Landed in torch's memory, the small tensors of one message share
        # one allocation (views of one storage at 256-byte-aligned offsets).
        got, out["many_storages"] = rpc.rpc_sync(
            "worker1", echo_with_storages, args=([cuda_tensor(b) for b in many],))
        out["many"] = [tensor_bytes(g) for g in got] == many
        # A strided view (every fourth column: a quarter of its span) travels
        # packed and arrives contiguous.
        view, packed = cuda_view(pattern(1 << 20, 3), (256, 1024), (slice(None), slice(3, None, 4)))
        out["view"] = rpc.rpc_sync("worker1", layout, args=(view,)) == (
            f"cuda:{target}", (256, 256), (256, 1), packed)
        out["channels"] = agent.get_debug_info().get("rpc_ext.peer.worker1.channels")
    else:
        # No map from worker1 to worker0: a CUDA tensor is refused, naming it.
        try:
            rpc.rpc_sync("worker0", identity, args=(cuda_tensor(b"x" * 64),))
            out["unmapped"] = ""
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["unmapped"] = str(e)
    if rank == 0:
        out["counters"] = {c: channel_counters(c) for c in channels}
        out["callee_counters"] = {
            c: rpc.rpc_sync("worker1", channel_counters, args=(c,)) for c in channels}
    out["numba_loaded"] = "numba" in sys.modules
    # Where an import of numba would come from (found, not run).
    spec = importlib.util.find_spec("numba")
    out["numba_origin"] = spec.origin if spec else None
    # The primary contexts this process holds, by device (the fake's count).
    stats = fake_stats()
    out["retains"] = stats["live"]["context_retains_by_device"] if stats else None
    rpc.shutdown()
    ctl.send(out)


# ---- cuda_ring: large tensors through a shared pinned ring ---------------------

RING_SIZES = (40 << 20, (5 << 20) + 123, 1 << 20)  # past the ring; odd; its minimum
RING_CONCURRENT = 4  # calls of RING_CONCURRENT_BYTES at once, both ways
RING_CONCURRENT_BYTES = 12 << 20
RING_VIEW_SPAN = 4 << 20  # a float32 1024 x 1024, every other column sent


def big_cuda_tensor(data: bytes) -> torch.Tensor:
    """cuda_tensor() for megabytes (no list of ints on the way)."""
    if real_cuda():
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(f"cuda:{DEVICE}")
    return cuda_tensor_from(data)


def cuda_tensor_from(data: bytes) -> torch.Tensor:
    p = cu().mem_alloc(DEVICE, len(data))
    cu().write(DEVICE, p, data)
    _KEEP.append(p)
    return cu().device_tensor(p, [len(data)], torch.empty(len(data), dtype=torch.uint8), DEVICE)


def large_round_trips(rng, sizes, view_span: int, concurrent: int,
                      concurrent_bytes: int) -> dict:
    """worker0's side: a tensor of each of `sizes` to worker1's identity and
    back (`back`: device, bytes intact), a strided view (every other column
    of a float32 1024 x 1024 of `view_span` bytes: `view`, shape and bytes),
    then `concurrent` calls of `concurrent_bytes` at once (`concurrent`)."""
    out = {}
    datas = [rng.randbytes(n) for n in sizes]
    backs = [rpc.rpc_sync("worker1", identity, args=(big_cuda_tensor(d),)) for d in datas]
    out["back"] = [(str(b.device), tensor_bytes(b) == d) for b, d in zip(backs, datas)]
    view, packed = cuda_view(rng.randbytes(view_span), (1024, 1024),
                             (slice(None), slice(0, None, 2)))
    back = rpc.rpc_sync("worker1", identity, args=(view,))
    out["view"] = (tuple(back.shape), tensor_bytes(back) == packed)
    datas = [rng.randbytes(concurrent_bytes) for _ in range(concurrent)]
    futs = [rpc.rpc_async("worker1", identity, args=(big_cuda_tensor(d),)) for d in datas]
    out["concurrent"] = [tensor_bytes(f.wait()) == d for f, d in zip(futs, datas)]
    return out


def run_ring(rank: int, port: int, ctl, channels, target: int = DEVICE) -> None:
    """worker0 sends tensors of 1 MiB to 40 MiB (past the ring's 32 MiB, so
    its slots are reused within one tensor) to worker1 and gets them back,
    then RING_CONCURRENT such calls at once (requests and responses in
    flight both ways, each direction's ring waiting on the other's
    releases). Reports whether every byte came back, both sides' cuda_ring
    and cuda_staged counters and the driver's (fake's) copies of pageable
    host memory."""
    import random

    join_pair(rank, port, target, device_channels=channels)
    out = {}
    if rank == 0:
        try:
            # The strided view: packed on the device as it is copied at the
            # send, then through the ring.
            out.update(large_round_trips(random.Random(7), RING_SIZES, RING_VIEW_SPAN,
                                         RING_CONCURRENT, RING_CONCURRENT_BYTES))
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
        out["counters"] = {c: channel_counters(c) for c in channels}
        out["callee_counters"] = {
            c: rpc.rpc_sync("worker1", channel_counters, args=(c,)) for c in channels}
        out["callee_pageable"] = rpc.rpc_sync("worker1", pageable_copies)
        out["pageable"] = pageable_copies()
    rpc.shutdown()
    ctl.send(out)


def rings_dropped(n: int, peer: str | None = None) -> bool:
    """Waits (30 s at most) until this worker's cuda_ring counters, and
    `peer`'s, say `n` rings dropped: a drop takes the idle time, a
    heartbeat tick and the peer's kRingDrop, which a loaded host delays."""
    deadline = time.monotonic() + 30
    while True:
        sides = [channel_counters("cuda_ring")]
        if peer is not None:
            sides.append(rpc.rpc_sync(peer, channel_counters, args=("cuda_ring",)))
        if all(side["dropped"] >= n for side in sides):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def run_ring_idle(rank: int, port: int, ctl) -> None:
    """A 2 MiB round trip through cuda_ring, a pause past the rings' idle
    time (the test sets TORCH_RPC_EXT_CUDA_RING_IDLE_MS; heartbeat ticks
    every 200 ms look for idle rings), then another: reports both sides'
    counters after the pause and at the end, and whether the bytes came
    back each time."""
    import random

    join_pair(rank, port, device_channels=("cuda_ring", "cuda_staged"), heartbeat_timeout=1)
    out = {}
    if rank == 0:
        rng = random.Random(3)
        out["back"] = []
        for i in range(2):
            data = rng.randbytes(2 << 20)
            back = rpc.rpc_sync("worker1", identity, args=(big_cuda_tensor(data),))
            out["back"].append(tensor_bytes(back) == data)
            rings_dropped(i + 1, "worker1")
            out.setdefault("ours", []).append(channel_counters("cuda_ring"))
            out.setdefault("theirs", []).append(
                rpc.rpc_sync("worker1", channel_counters, args=("cuda_ring",)))
    rpc.shutdown()
    ctl.send(out)


def run_ring_dropped_while_set_up(rank: int, port: int, ctl) -> None:
    """Rings dropped as soon as idle (the test sets
    TORCH_RPC_EXT_CUDA_RING_IDLE_MS=0; heartbeat ticks every 200 ms look
    for idle rings): after a first round trip's ring went, worker0 sends a
    larger tensor while its driver takes a second over each allocation, so
    ticks come between the new ring's making and its first segment's
    setup (its staging block's allocation)."""
    import random

    from tests.cuda_driver.worker import set_fake_alloc_delay

    join_pair(rank, port, device_channels=("cuda_ring", "cuda_staged"), heartbeat_timeout=1)
    out = {}
    if rank == 0:
        rng = random.Random(4)
        out["back"] = []
        for n in (2 << 20, 6 << 20):
            data = rng.randbytes(n)
            t = big_cuda_tensor(data)
            rings_dropped(len(out["back"]))  # past the first ring's drop
            set_fake_alloc_delay(1000 if n > 2 << 20 else 0)
            try:
                back = rpc.rpc_sync("worker1", identity, args=(t,))
                out["back"].append(tensor_bytes(back) == data)
            except Exception as e:  # noqa: BLE001 - the message is the result
                out["back"].append(str(e))
            finally:
                set_fake_alloc_delay(0)
        out["ours"] = channel_counters("cuda_ring")
    rpc.shutdown()
    ctl.send(out)


def pageable_copies():
    stats = fake_stats()
    return stats["pageable_copies"] if stats else None


# ---- a block's release while the callee is busy --------------------------------


def slow_len(t, seconds: float) -> int:
    time.sleep(seconds)
    return t.numel()


def run_release_ride(rank: int, port: int, ctl, ride_ms: str) -> None:
    """worker0 sends a CUDA tensor to a function that sleeps 4 s; meanwhile
    it asks worker1 (a CPU call) how many releases it sent. A block's
    release waits to ride with worker1's next frame, at most
    TORCH_RPC_EXT_CUDA_RELEASE_RIDE_MS (`ride_ms`): with the default it goes
    on its own long before the slow function returns."""
    os.environ["TORCH_RPC_EXT_CUDA_RELEASE_RIDE_MS"] = ride_ms
    # (No heartbeat tick, which flushes waiting releases too, in the window.)
    join_pair(rank, port, heartbeat_timeout=60)
    out = {}
    if rank == 0:
        slow = rpc.rpc_async("worker1", slow_len, args=(cuda_tensor(b"r" * 4096), 4.0))
        # Long past the 10 ms ride (a loaded host lands the block late),
        # well before the function returns.
        time.sleep(2.0)
        during = rpc.rpc_sync("worker1", channel_counters)
        out["during"] = (during["releases"], during["release_frames"])
        out["len"] = slow.wait()
        out["after"] = channel_counters()  # ours: the owner's side
    rpc.shutdown()
    ctl.send(out)


# ---- received tensors on a busy side stream -----------------------------------


def make(n: int, seed: int):
    return cuda_tensor(pattern(n, seed))


def run_side_stream(rank: int, port: int, ctl, channels, zero_copy: bool,
                    granted: bool = False) -> None:
    """worker0, on a side stream kept busy, receives a tensor, queues a copy
    of it behind the busy work, drops it, and receives more of the same
    size: the issue's `r = rpc_sync(...); acc += r; del r`. Under torch's
    stream rules (the future's wait() records the tensor's memory on the
    side stream) the copy must read the first tensor's bytes, whatever the
    later calls reused meanwhile.

    `granted`: tensors over 1 MiB, after a first call that makes worker0
    grant their size (docs/cuda.md, "Grants"): the received tensors are
    blocks of the landing pool the peer wrote into, and the grant made
    after the second call must not be the first tensor's block, freed but
    not yet passed by the side stream: the third call's bytes would land
    under the queued copy."""
    join_pair(rank, port, device_channels=channels, cuda_zero_copy=zero_copy)
    out = {}
    if rank == 0:
        n = (3 << 20) if granted else (1 << 20)
        seeds = (7, 8, 9) if granted else (7, 8)
        first, *later = [pattern(n, s) for s in seeds]
        if granted:
            rpc.rpc_sync("worker1", make, args=(n, 6))  # lands by copy; a grant follows
        if real_cuda():
            acc = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{DEVICE}")
            side = torch.cuda.Stream(DEVICE)
            with torch.cuda.stream(side):
                torch.cuda._sleep(2_000_000_000)  # about a second of busy stream
                r = rpc.rpc_sync("worker1", make, args=(n, seeds[0]))
                acc.copy_(r)
                del r
                rs = [rpc.rpc_sync("worker1", make, args=(n, s)) for s in seeds[1:]]
            side.synchronize()
            out["later"] = [r.cpu().numpy().tobytes() == b for r, b in zip(rs, later)]
            out["first_intact"] = acc.cpu().numpy().tobytes() == first
        else:
            acc = cuda_tensor(b"\0" * n)
            side = cu().new_stream(DEVICE)
            before = cu().use_stream(DEVICE, side)
            hold = cu().hold_stream(DEVICE, side)
            try:
                r = rpc.rpc_sync("worker1", make, args=(n, seeds[0]))
                cu().copy_async(acc.data_ptr(), r.data_ptr(), n, DEVICE, side)
                del r
                rs = [rpc.rpc_sync("worker1", make, args=(n, s)) for s in seeds[1:]]
                # The later tensors' bytes are in place (their memory read
                # outside any stream) before the side stream goes on.
                deadline = time.monotonic() + 10
                while (any(cu().read(DEVICE, r.data_ptr(), n) != b for r, b in zip(rs, later))
                       and time.monotonic() < deadline):
                    time.sleep(0.01)
                out["later"] = [cu().read(DEVICE, r.data_ptr(), n) == b
                                for r, b in zip(rs, later)]
            finally:
                cu().release_stream(hold)
            cu().stream_synchronize(DEVICE, cu().stream_handle(DEVICE, side))
            cu().use_stream(DEVICE, before)
            out["first_intact"] = cu().read(DEVICE, acc.data_ptr(), n) == first
            out["allocator"] = cu().allocator_stats()
        out["landed"] = {k: int(v) for k, v in agent_metrics().items()
                         if k.startswith(("rpc_ext.cuda.land", "rpc_ext.cuda.granted"))}
    rpc.shutdown()
    ctl.send(out)


# ---- grants outgrown --------------------------------------------------------------

# Two sizes taking turns (a grant each: two slots), then a third (the
# oldest grant makes room); a grant holds at most twice its segment.
GROWTH = (2 << 20, 5 << 20) * 3 + (12 << 20,) * 3


def granted() -> int:
    return int(agent_metrics()["rpc_ext.cuda.granted_segments"])


def run_grant_growth(rank: int, port: int, ctl) -> None:
    """With the landing pool on (grants), worker0 sends tensors of GROWTH's
    sizes to worker1's identity one after another. `granted`: per call, the
    segments that landed in grants on worker0 (the answer) and on worker1
    (the request); every byte checked (`back`)."""
    join_pair(rank, port)
    out = {}
    if rank == 0:
        rng = random.Random(5)
        out["back"], out["granted"] = [], []
        for i, n in enumerate(GROWTH):
            if i == len(GROWTH) - 2:
                # Both revokes answered, and the new grant made on each
                # side (it follows the return; a third grant each). The
                # round trip below carries each to its sender before the
                # call: made before it, it is queued ahead of it.
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    sides = (channel_counters(), rpc.rpc_sync("worker1", channel_counters))
                    if all(c["grants_returned"] >= 1 and c["grants_made"] >= 3 for c in sides):
                        break
                    time.sleep(0.01)
            before = (granted(), rpc.rpc_sync("worker1", granted))
            data = rng.randbytes(n)
            back = rpc.rpc_sync("worker1", identity, args=(big_cuda_tensor(data),))
            out["back"].append(tensor_bytes(back) == data)
            out["granted"].append((granted() - before[0],
                                   rpc.rpc_sync("worker1", granted) - before[1]))
        out["counters"] = (channel_counters(), rpc.rpc_sync("worker1", channel_counters))
    rpc.shutdown()
    ctl.send(out)


def run_grant_view(rank: int, port: int, ctl) -> None:
    """With the landing pool on, worker0 sends a strided view (every other
    column of a float32 1024 x 2048: 4 MiB packed) to worker1's identity
    three times. `granted`: per call, the segments that landed in grants on
    worker0 (the dense answer) and on worker1 (the view, packed by the
    sender straight into worker1's grant); `back`: shape and bytes."""
    join_pair(rank, port)
    out = {}
    if rank == 0:
        rng = random.Random(7)
        out["back"], out["granted"] = [], []
        for _ in range(3):
            view, packed = cuda_view(rng.randbytes(8 << 20), (1024, 2048),
                                     (slice(None), slice(0, None, 2)))
            before = (granted(), rpc.rpc_sync("worker1", granted))
            back = rpc.rpc_sync("worker1", identity, args=(view,))
            out["back"].append((tuple(back.shape), tensor_bytes(back) == packed))
            out["granted"].append((granted() - before[0],
                                   rpc.rpc_sync("worker1", granted) - before[1]))
    rpc.shutdown()
    ctl.send(out)


# ---- idle blocks dropped --------------------------------------------------------


def poisoned_uses() -> int | None:
    stats = fake_stats()
    return stats["poisoned_uses"] if stats else None


def there_and_back(nbytes: int, seed: int) -> bool:
    """A CUDA tensor to worker1 and back (a block of each worker's lent to
    the other): whether its bytes came back whole. Nothing of it is kept."""
    data = pattern(nbytes, seed)
    back = rpc.rpc_sync("worker1", identity, args=(cuda_tensor(data),))
    return tensor_bytes(back) == data


def run_drop(rank: int, port: int, ctl) -> None:
    """A tensor there and back (a block of each worker's lent to the
    other), then both idle until each has dropped its block (kBlockIdleMs):
    the owner frees a block only once the importer closed it, so no process
    uses an event or legacy mapping its exporter already destroyed or freed
    (the fake counts such uses)."""
    join_pair(rank, port)
    out = {}
    if rank == 0:
        out["back"] = there_and_back(3 << 20, 9)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            mine = channel_counters()
            theirs = rpc.rpc_sync("worker1", channel_counters)
            if mine["blocks_unmapped"] >= 1 and theirs["blocks_unmapped"] >= 1:
                break
            time.sleep(0.2)
        out["unmapped"] = (mine["blocks_unmapped"], theirs["blocks_unmapped"])
        out["created"] = (mine["blocks_created"], theirs["blocks_created"])
        time.sleep(0.5)  # a late use would come after the free
        out["poisoned"] = (poisoned_uses(), rpc.rpc_sync("worker1", poisoned_uses))
    rpc.shutdown()
    ctl.send(out)


def run_shutdown(rank: int, port: int, ctl) -> None:
    """A tensor there and back (a block of each worker's lent to the
    other), then straight to rpc.shutdown(). Each worker reports, once its
    teardown has closed every import of its peer's blocks (the fake's
    opened events), how many times it used an event or legacy mapping its
    exporter had already destroyed or freed."""
    join_pair(rank, port)
    out = {}
    if rank == 0:
        out["back"] = there_and_back(3 << 20, 5)
    rpc.shutdown()
    deadline = time.monotonic() + 30
    while fake_stats()["live"]["opened_ipc_events"] and time.monotonic() < deadline:
        time.sleep(0.05)
    out["opened"] = fake_stats()["live"]["opened_ipc_events"]
    out["poisoned"] = poisoned_uses()
    ctl.send(out)


# ---- a graph captured while tensors move -------------------------------------


def pound(calls: int) -> bool:
    """On worker1: `calls` CUDA tensors to worker0 and back, bytes checked."""
    for i in range(calls):
        data = pattern((1 << 20) + i, i)
        back = rpc.rpc_sync("worker0", identity, args=(cuda_tensor(data),))
        if tensor_bytes(back) != data:
            return False
    return True


def set_global_capture(on: bool) -> None:
    """The fake's flag: a stream of this process captures in global mode."""
    import ctypes

    ctypes.CDLL(os.environ["TORCH_RPC_EXT_LIBCUDA"]).fake_cuda_set_global_capture(int(on))


def run_capture(rank: int, port: int, ctl, channels) -> None:
    """worker0 captures a CUDA graph in global mode (torch.cuda.graph's
    default) while worker1 moves CUDA tensors to it and back: the agent's
    threads (loops, staging, landing, trimming) keep making driver calls,
    which must not invalidate the capture."""
    join_pair(rank, port, both=True, device_channels=channels)
    out = {}
    if rank == 0:
        fut = rpc.rpc_async("worker1", pound, args=(8,))
        try:
            if real_cuda():
                x = torch.ones(1 << 20, device=f"cuda:{DEVICE}")
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = x * 2
                    while not fut.done():
                        time.sleep(0.01)
                graph.replay()
                out["graph"] = bool((y == 2).all())
            else:
                set_global_capture(True)
                try:
                    while not fut.done():
                        time.sleep(0.01)
                finally:
                    set_global_capture(False)
                stats = fake_stats()
                out["violations"] = stats["capture_violations"]
                out["last_error"] = stats["last_error"]
            out["pounded"] = fut.wait()
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
    rpc.shutdown()
    ctl.send(out)


# ---- out of device memory -------------------------------------------------------

MIB = 1 << 20


def run_memory(rank: int, port: int, ctl, case: str) -> None:
    """A 3 MiB tensor there and back through cuda_ipc, with worker0 short
    of memory for its block (both run under $FAKE_CUDA_MEM_LIMIT=16 MiB,
    where set): `cache`, 10 MiB sit in torch's cache (torch would give them
    back); `held`, 10 MiB are held by live tensors (nothing to give back);
    `limit`, no shortage, but cuda_ipc_memory_limit=1 MiB."""
    join_pair(rank, port, cuda_ipc_memory_limit=MIB if case == "limit" else 2 << 30)
    out = {}
    if rank == 0:
        data = pattern(3 * MIB, 11)
        t = cuda_tensor(data)
        if case == "cache":
            cu().cache_bytes(DEVICE, 10 * MIB)
        elif case == "held":
            cuda_tensor(bytes(10 * MIB))  # kept (_KEEP)
        try:
            back = rpc.rpc_sync("worker1", identity, args=(t,))
            out["back"] = tensor_bytes(back) == data
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
        out["ipc"] = channel_counters("cuda_ipc")
        out["staged"] = channel_counters("cuda_staged")
        out["ring"] = channel_counters("cuda_ring")
        out["memory"] = {k[len("rpc_ext.cuda."):]: int(v) for k, v in agent_metrics().items()
                         if k.startswith("rpc_ext.cuda.") and not k.startswith("rpc_ext.cuda.land")}
        if not real_cuda():
            out["allocator"] = cu().allocator_stats()
    rpc.shutdown()
    ctl.send(out)


def agent_metrics():
    return rpc.api._get_current_rpc_agent().get_metrics()


# ---- a worker's calls to itself ----------------------------------------------


def init_self(port: int, **options) -> None:
    """A world of one, worker0, its cuda:DEVICE mapped to itself."""
    setup_torch()
    opts = torch_rpc_ext.RpcExtBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", address="127.0.0.1",
        num_worker_threads=4, rpc_timeout=TIMEOUT, **options)
    opts.set_device_map("worker0", {DEVICE: DEVICE})
    rpc.init_rpc("worker0", rank=0, world_size=1,
                 backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)


def run_self(port: int, ctl, zero_copy: bool = False) -> None:
    """One worker maps its cuda:0 to its own cuda:0 (upstream's device-map
    tests send to self) and calls itself with CUDA tensors both ways, a
    strided view and many small ones among them: its own IPC handles would
    not open in it, so cuda_ipc declines, and cuda_self copies them on the
    device."""
    init_self(port, cuda_zero_copy=zero_copy)
    out = {}
    try:
        data = pattern(3 << 20, 5)
        out["seen"] = rpc.rpc_sync("worker0", describe, args=(cuda_tensor(data),)) == (
            f"cuda:{DEVICE}", data)
        sent = cuda_tensor(data)
        back = rpc.rpc_sync("worker0", identity, args=(sent,))
        out["back"] = (str(back.device), tensor_bytes(back) == data)
        # A copy, not the sender's memory, even under cuda_zero_copy.
        out["distinct"] = back.data_ptr() != sent.data_ptr()
        view, packed = cuda_view(pattern(1 << 20, 3), (256, 1024), (slice(None), slice(3, None, 4)))
        out["view"] = rpc.rpc_sync("worker0", layout, args=(view,)) == (
            f"cuda:{DEVICE}", (256, 256), (256, 1), packed)
        many = [pattern(1024, k) for k in range(MANY)]
        got = rpc.rpc_sync("worker0", identity, args=([cuda_tensor(m) for m in many],))
        out["many"] = [tensor_bytes(t) for t in got] == many
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["error"] = str(e)
    out["counters"] = {c: channel_counters(c) for c in ("cuda_ipc", "cuda_self", "cuda_staged")}
    rpc.shutdown()
    ctl.send(out)


def device_of(t) -> str:
    return str(t.device)


def run_traced_self(port: int, ctl) -> None:
    """run_self's worker traced with OpenTelemetry's SDK: a Python function
    served a CUDA tensor has an rpc.land span (the tensor's landing) under
    its rpc.serve span; a call with CPU tensors only has none."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    init_self(port)
    out = {}
    try:
        data = pattern(1 << 20, 7)
        with trace.get_tracer("test").start_as_current_span("step"):
            out["seen"] = rpc.rpc_sync("worker0", describe, args=(cuda_tensor(data),)) == (
                f"cuda:{DEVICE}", data)
            out["cpu"] = rpc.rpc_sync("worker0", device_of, args=(torch.ones(4),)) == "cpu"
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["error"] = str(e)
    rpc.shutdown()
    out["spans"] = [
        {"name": s.name, "id": s.context.span_id, "trace": s.context.trace_id,
         "parent": s.parent.span_id if s.parent else None,
         "start": s.start_time, "end": s.end_time}
        for s in exporter.get_finished_spans()]
    ctl.send(out)


# ---- a dynamic group (init_rpc without world_size) ---------------------------


def run_dynamic(rank: int, store_path: str, ctl, gates) -> None:
    """worker0 joins receiving on cuda:0; worker2 tries to join with a map
    to a device worker0 does not receive on, and is refused; then worker1
    joins with a map {0: 0} to worker0 and moves CUDA tensors both ways (the
    answers through the reverse of its map, which worker0 learns from its
    join record)."""
    setup_torch()
    name = f"worker{rank}"
    opts = torch_rpc_ext.RpcExtBackendOptions(
        init_method=f"file://{store_path}", address="127.0.0.1", num_worker_threads=4,
        rpc_timeout=TIMEOUT)
    out = {}

    def say(what: str) -> None:  # where a hung worker got to, on stderr
        print(f"{name} {time.monotonic():.1f}: {what}", file=sys.stderr, flush=True)

    def join():
        say("joining")
        rpc.init_rpc(name, rank=rank, backend=rpc.BackendType.TORCH_RPC_EXT,
                     rpc_backend_options=opts)
        say("joined")

    if rank == 0:
        opts.devices = [torch.device("cuda", DEVICE)]
        join()
        gates["0"].set()
        out["done_gate"] = gates["done"].wait(60)
        out["counters"] = channel_counters()
        out["devices"] = [str(d) for d in rpc.api._get_current_rpc_agent()._get_devices()]
    elif rank == 2:
        out["gate0"] = gates["0"].wait(60)
        opts.set_device_map("worker0", {DEVICE: 1})
        try:
            join()
            out["refused"] = ""
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["refused"] = str(e)
        say(f"refused: {out['refused'][:200]!r}")
        gates["2"].set()
        ctl.send(out)
        return
    else:
        out["gate2"] = gates["2"].wait(60)
        opts.set_device_map("worker0", {DEVICE: DEVICE})
        join()
        data = pattern(3 << 20, 4)
        t = cuda_tensor(data)
        out["seen_by_worker0"] = rpc.rpc_sync("worker0", describe, args=(t,)) == (
            f"cuda:{DEVICE}", data)
        back = rpc.rpc_sync("worker0", identity, args=(t,))
        out["back"] = (str(back.device), tensor_bytes(back) == data)
        out["channels"] = rpc.api._get_current_rpc_agent().get_debug_info().get(
            "rpc_ext.peer.worker0.channels")
        gates["done"].set()
    say("shutting down")
    rpc.shutdown()
    say("shut down")
    ctl.send(out)


if __name__ == "__main__":  # pragma: no cover - used by spawn only
    os._exit(1)


# ---- functions registered by name (torch_rpc_ext.scripting) --------------------


def intact(t, seed: int) -> bool:
    """Whether `t` holds pattern(len, seed), read in order after the work
    queued on the current stream (where the function runs)."""
    return tensor_bytes(t) == pattern(t.numel(), seed)


def on_host(t):
    """A value on the CPU whatever the argument's device."""
    return torch.zeros(2)


def run_named(rank: int, port: int, ctl) -> None:
    """worker0 calls functions worker1 registered by name
    (torch_rpc_ext.scripting) with CUDA tensors never seen before, whose
    landing the fake runs 50 ms late: a function must run under the
    streams the tensors arrived on (ordered after their landing), and its
    answer must be sent after them. A Python UDF's call, upstream's path,
    is the control."""
    from torch_rpc_ext import scripting

    join_pair(rank, port)
    out = {}
    if rank == 1:
        scripting.register("intact", intact)
        scripting.register("identity", identity)
        scripting.register("on_host", on_host)
    rpc.api._barrier([f"worker{r}" for r in range(2)])
    if rank == 0:
        n = 1 << 20
        out["udf"] = rpc.rpc_sync("worker1", intact, args=(cuda_tensor(pattern(n, 21)), 21))
        out["named"] = scripting.rpc_sync("worker1", "intact", cuda_tensor(pattern(n, 22)), 22)
        back = scripting.rpc_sync("worker1", "identity", cuda_tensor(pattern(n, 23)))
        out["named_back"] = (str(back.device), tensor_bytes(back) == pattern(n, 23))
        # torch.compile's op (called as compiled code calls it): its fake
        # put the value on cuda:0, the arguments' device, so a CPU one is
        # refused, not handed to code that reads it as device memory.
        try:
            torch.ops.torch_rpc_ext.call_tensors(
                "worker1", "on_host", [cuda_tensor(pattern(16, 24))], "", -1.0)
            out["compiled_on_host"] = None
        except RuntimeError as e:
            out["compiled_on_host"] = str(e)
    rpc.shutdown()
    ctl.send(out)



# ---- a function that changes the current device -----------------------------


def leave_device(d: int) -> int:
    """torch.cuda.set_device(d) without a `with`: what a function may do."""
    if real_cuda():
        torch.cuda.set_device(d)
    else:
        cu().set_device(d)
    return d


def current_device() -> int:
    return torch.cuda.current_device() if real_cuda() else cu().current_device()


def run_device_left(rank: int, port: int, ctl) -> None:
    """worker1 (devices cuda:0 and cuda:1) serves functions that leave
    cuda:1 current, then functions that report the current device: each
    must find cuda:0, the serving thread's own, whichever thread serves
    it (torch's invokeCallback restores the device around a callback)."""
    join_pair(rank, port, target=1)
    out = {}
    if rank == 0:
        rounds = 12
        futs = [rpc.rpc_async("worker1", leave_device, args=(1,)) for _ in range(rounds)]
        [f.wait() for f in futs]
        for _ in range(rounds):
            rpc.rpc_sync("worker1", leave_device, args=(1,))
        out["seen"] = [rpc.rpc_sync("worker1", current_device) for _ in range(2 * rounds)]
    rpc.shutdown()
    ctl.send(out)
