# SPDX-License-Identifier: BSD-3-Clause
"""Two workers calling each other at once, for a while, with random mixes
of CUDA and CPU tensors (test_agent_soak.py): what no single-purpose test
of cuda_ipc does, all of it at the same time on one connection.

Each worker runs THREADS callers, each sending a few calls at once, so
requests and responses cross in both directions and blocks are lent, used,
released (riding the other side's frames) and reused while other messages
are in flight. A message holds CUDA tensors of random sizes (empty to 3 MiB,
so some are packed into a shared block and some take a block of their own),
views (packed by a kernel or whole rows), the same tensor twice (one
storage), and CPU tensors. The callee checks each
tensor's bytes as it received them (digests sent beside), sometimes sends a
part back to the caller from inside the serve (a call made while serving
one), makes a fresh CUDA tensor, and returns what it got; the caller checks
every byte that came back. Same helpers as agent_worker.py, so it runs on
the fake (CPU torch) and on a GPU alike."""

import hashlib
import random
import threading
import time
import traceback

from torch.distributed import rpc

from tests.cuda_driver import agent_worker as aw
from tests.cuda_driver.worker import fake_stats

THREADS = 2  # callers per worker
IN_FLIGHT = 3  # calls each caller has outstanding at most
CALL_TIMEOUT = 60
# Each caller makes at least this many calls, however slow the host: past
# the deadline it goes on until it has them (up to OVERTIME_S more), so
# the test's floor on calls is an event that happens, not a rate (a loaded
# CI host made 9 in the 10 s once).
MIN_CALLS = 10
OVERTIME_S = 40  # at most; less for long soaks (run()), inside agent_worker's 150 s watchdog


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


ARENA = 12 << 20  # bytes of device memory every fake tensor of a worker views


def arena_bytes(seed: int) -> bytes:
    """agent_worker.pattern(ARENA, seed), made in one pass of torch."""
    import torch

    values = (torch.arange(ARENA, dtype=torch.int64) * 13 + seed) % 251
    return values.to(torch.uint8).numpy().tobytes()


class Source:
    """CUDA tensors holding known bytes. On a GPU, torch's (freed as usual).
    On the fake, whose tensors are views of raw device memory that nothing
    frees, views at random offsets into one arena of pattern(ARENA, seed),
    written once: each a storage of its own, as torch's would be."""

    def __init__(self, seed: int):
        import torch

        self.data = arena_bytes(seed)
        if aw.real_cuda():
            self.arena = torch.frombuffer(bytearray(self.data), dtype=torch.uint8).to(
                f"cuda:{aw.DEVICE}")
        else:
            self.base = aw.cu().mem_alloc(aw.DEVICE, ARENA)
            aw.cu().write(aw.DEVICE, self.base, self.data)

    def tensor(self, offset: int, n: int):
        """The arena's bytes [offset, offset + n) as a CUDA tensor."""
        import torch

        if aw.real_cuda():
            return self.arena[offset:offset + n].clone()
        like = torch.empty(0, dtype=torch.uint8)
        return aw.cu().device_tensor(self.base + offset, [n], like, aw.DEVICE)

    def view(self, offset: int, shape, index):
        """A float32 view through `index` of the arena's bytes at `offset`
        shaped `shape`, and its bytes packed in row-major order."""
        import torch

        data = self.data[offset:offset + shape[0] * shape[1] * 4]
        if aw.real_cuda():
            return aw.cuda_view(data, shape, index)
        host = torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)
        want = host[index]
        view = aw.cu().device_tensor(self.base + offset + want.storage_offset() * 4,
                                     list(want.shape), host, aw.DEVICE, list(want.stride()))
        return view, want.contiguous().numpy().tobytes()


def _contiguous(rng: random.Random, src: Source) -> tuple[list, list[bytes]]:
    n = rng.choice([
        0,
        rng.randint(1, 255),  # odd, unaligned sizes
        rng.randint(256, 64 << 10),  # packed with others into a block
        rng.randint(64 << 10, 1 << 20),
        rng.randint(1 << 20, 3 << 20),  # a block of its own past 1 MiB
    ])
    if rng.random() < 0.01:  # now and then, one the driver copies (8 MiB on)
        n = rng.randint(8 << 20, 9 << 20)
    offset = rng.randint(0, ARENA - n)
    t = src.tensor(offset, n)
    return [t], [src.data[offset:offset + n]]


def _view(rng: random.Random, src: Source) -> tuple[list, list[bytes]]:
    rows, cols = rng.choice([(16, 64), (64, 256), (128, 1024)])
    index = rng.choice([
        (slice(None), slice(rng.randint(0, 3), None, rng.randint(2, 5))),  # columns: the kernel
        (slice(rng.randint(0, rows // 2), rows), slice(None)),  # whole rows at an offset
        (slice(None, None, 2), slice(None)),  # every other row: a pitched copy
    ])
    offset = 4 * rng.randint(0, (ARENA - rows * cols * 4) // 4)
    view, packed = src.view(offset, (rows, cols), index)
    return [view], [packed]


def _twice(rng: random.Random, src: Source) -> tuple[list, list[bytes]]:
    ts, ds = _contiguous(rng, src)
    return ts * 2, ds * 2  # one storage, twice in the message


def _cpu(rng: random.Random, src: Source) -> tuple[list, list[bytes]]:
    import torch

    data = aw.pattern(rng.randint(0, 8 << 10), rng.randrange(251))
    return [torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
            else torch.empty(0, dtype=torch.uint8)], [data]


KINDS = [(_contiguous, 6), (_view, 2), (_twice, 1), (_cpu, 1)]


def payload(rng: random.Random, src: Source) -> tuple[list, list[bytes]]:
    """1 to 40 tensors (a few messages of many small ones), and the bytes
    each should arrive with (a view's packed in row-major order)."""
    tensors, want = [], []
    count = rng.choice([1, 2, 3, rng.randint(4, 40)])
    while len(tensors) < count:
        make = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
        ts, ds = make(rng, src)
        tensors += ts
        want += ds
    return tensors, want


def read(t) -> bytes:
    """A tensor's bytes in row-major order. (A view that uses most of its
    span travels as the span and arrives a view too: docs/wire-format.md.)"""
    import torch

    if not t.is_cuda:
        return t.contiguous().numpy().tobytes()
    if aw.real_cuda() or t.is_contiguous():
        return aw.tensor_bytes(t.contiguous() if aw.real_cuda() else t)
    # The fake runs no kernel: the span's bytes, then the view made here.
    if t.numel() == 0:
        return b""
    elements = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    span = aw.cu().device_tensor(t.data_ptr(), [elements * t.element_size()],
                                 torch.empty(0, dtype=torch.uint8), t.device.index)
    host = torch.frombuffer(bytearray(aw.tensor_bytes(span)), dtype=t.dtype)
    return host.as_strided(t.shape, t.stride()).contiguous().numpy().tobytes()


# ---- run on the callee -----------------------------------------------------------


def serve(tensors, digests, back_to, part, fresh):
    """The received tensors' bytes against the caller's digests; `part` of
    them sent back to `back_to` from inside this serve (when named); and a
    fresh CUDA tensor made here: this worker's arena bytes at `fresh`
    (offset, length). Returns the tensors as received, and what it found."""
    wrong = [i for i, (t, d) in enumerate(zip(tensors, digests)) if digest(read(t)) != d]
    nested = None
    if back_to is not None:
        sub = tensors[:part]
        back = rpc.rpc_sync(back_to, aw.identity, args=(sub,), timeout=CALL_TIMEOUT)
        nested = [read(a) == read(b) for a, b in zip(back, sub)] == [True] * len(sub)
    return tensors, wrong, nested, _SOURCE.tensor(*fresh)


_SOURCE: Source | None = None  # this worker's arena
_FINISHED = False  # this worker's callers are done


def ready() -> bool:
    return _SOURCE is not None


def finished() -> bool:
    return _FINISHED


def arena_seed(rank: int) -> int:
    return 17 + rank


# ---- the workers -----------------------------------------------------------------


def _caller(rank: int, seed: int, deadline: float, overtime: float, peer_arena: bytes,
            report: dict, lock) -> None:
    """Calls until the deadline and MIN_CALLS calls (`overtime` seconds
    past the deadline at most); what it made and found goes into `report` however
    it ends (an exception of its own is a failure too, so a thread that
    dies cannot leave the other to pass the test alone)."""
    rng = random.Random(seed)
    me, peer = f"worker{rank}", f"worker{1 - rank}"
    calls = 0
    failures = []

    def more() -> bool:
        now = time.monotonic()
        return now < deadline or (calls < MIN_CALLS and now < deadline + overtime)

    try:
        while more() and len(failures) < 5:
            batch = []
            for _ in range(rng.randint(1, IN_FLIGHT)):
                tensors, want = payload(rng, _SOURCE)
                nested = rng.random() < 0.25
                n = rng.randint(1, 100 << 10)
                fresh = (rng.randint(0, ARENA - n), n)
                # One call in ten to this worker itself (cuda_self).
                to = me if rng.random() < 0.1 else peer
                fut = rpc.rpc_async(
                    to, serve, timeout=CALL_TIMEOUT,
                    args=(tensors, [digest(d) for d in want], me if nested else None,
                          rng.randint(1, len(tensors)), fresh))
                batch.append((fut, want, nested, fresh,
                              _SOURCE.data if to == me else peer_arena))
            for fut, want, nested, fresh, arena in batch:
                calls += 1
                try:
                    back, wrong, nested_ok, made = fut.wait()
                except Exception as e:  # noqa: BLE001 - reported, not raised
                    failures.append(f"call {calls}: {type(e).__name__}: {e}"[:400])
                    continue
                if wrong:
                    failures.append(f"call {calls}: the callee got tensors {wrong} of "
                                    f"{len(want)} wrong")
                if nested and not nested_ok:
                    failures.append(f"call {calls}: the nested call's bytes came back wrong")
                got = [read(t) for t in back]
                if got != want:
                    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
                    failures.append(f"call {calls}: tensors {bad} of {len(want)} came back "
                                    "wrong")
                if read(made) != arena[fresh[0]:fresh[0] + fresh[1]]:
                    failures.append(f"call {calls}: the callee's fresh tensor came back wrong")
    except Exception:  # noqa: BLE001 - reported, not raised
        failures.append(f"caller thread {seed} after {calls} calls: "
                        f"{traceback.format_exc()}"[-1500:])
    finally:
        with lock:
            report["calls"].append(calls)
            report["failures"] += failures


def join(rank: int, port: int, channels, zero_copy: bool, swap: bool) -> None:
    """Both map cuda:0 to the other's cuda:0; with `swap`, cuda:0 and
    cuda:1 to the other's cuda:1 and cuda:0 (two devices: every tensor
    crosses between devices, peer to peer)."""
    import torch_rpc_ext

    aw.setup_torch()
    opts = torch_rpc_ext.RpcExtBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", address="127.0.0.1",
        num_worker_threads=4, rpc_timeout=aw.TIMEOUT,
        device_channels=(*channels, "cuda_self"), cuda_zero_copy=zero_copy)
    opts.set_device_map(f"worker{1 - rank}", {0: 1, 1: 0} if swap else {0: 0})
    # And to itself (cuda_self), device for device.
    opts.set_device_map(f"worker{rank}", {0: 0, 1: 1} if swap else {0: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)


def run(rank: int, port: int, ctl, seconds: float, seed: int, zero_copy: bool,
        channels=("cuda_ipc",), swap: bool = False) -> None:
    """Both workers join (join()); each calls the other from THREADS
    threads for `seconds`, then reports its calls and failures."""
    global _SOURCE, _FINISHED
    join(rank, port, channels, zero_copy, swap)
    _SOURCE = Source(arena_seed(rank))
    peer_arena = arena_bytes(arena_seed(1 - rank))
    # Both start together (the first calls cross too), each once the
    # other's arena is there for its serves.
    while not rpc.rpc_sync(f"worker{1 - rank}", ready):
        time.sleep(0.05)
    report = {"calls": [], "failures": []}  # calls: each thread's
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    # The soak and its overtime leave the watchdog (which also counts the
    # start, the last batch and shutdown) 40 s at least.
    overtime = max(0.0, min(OVERTIME_S, aw.WATCHDOG_S - 40 - seconds))
    threads = [threading.Thread(target=_caller,
                                args=(rank, seed * 100 + 10 * rank + i, deadline, overtime,
                                      peer_arena,
                                      report, lock))
               for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Counters read once the peer's callers are done too: nothing large is
    # on its way, so none moves between the reads below.
    _FINISHED = True
    while not rpc.rpc_sync(f"worker{1 - rank}", finished):
        time.sleep(0.05)
    metrics = rpc.api._get_current_rpc_agent().get_metrics()
    report["receive_failures"] = int(metrics.get("rpc_ext.cuda.receive_failures", 0))
    report["counters"] = {c: aw.channel_counters(c) for c in channels}
    report["landing"] = {k: int(metrics.get(f"rpc_ext.cuda.{k}", 0)) for k in (
        "landing_allocations", "landing_pool_allocations", "landing_pool_segments",
        "granted_segments")}
    rpc.shutdown()
    stats = fake_stats()
    report["poisoned"] = stats["poisoned_uses"] if stats else None
    ctl.send(report)
