# SPDX-License-Identifier: BSD-3-Clause
"""What the tests of this folder run in processes of their own (spawned, or
forked from torch_rpc_ext/_preloaded.py's server) that load the fake CUDA driver
(tests/cuda_fake) through TORCH_RPC_EXT_LIBCUDA.

A process whose driver table is loaded holds driver threads and cannot be
forked safely, and the table is loaded once per process: so nothing here
runs in the pytest process, which forks the multi-process RPC tests.
"""

import os
from multiprocessing import reduction

import numpy as np

DEVICE = 0


def testing():
    from torch_rpc_ext import _testing

    return _testing.cuda


def kernel_images(compiled: bool = False) -> dict[str, tuple[str, str]]:
    """The kernels as the package ships them (ISA 6.0), or as numba-cuda
    compiles them here (`compiled`: NVVM 13's ISA 9.0)."""
    from torch_rpc_ext._cuda import ptx

    kernels = ptx.kernel_ptx() if compiled else ptx.shipped_ptx()
    return {name: (k.entry, k.ptx) for name, k in kernels.items()}


def describe() -> tuple[str, int, list[str]]:
    cu = testing()
    n = cu.device_count()
    return cu.libcuda_description(), n, [cu.device_uuid(d) for d in range(n)]


class Device:
    """Device memory, one stream and a copy engine (its own, or a shared
    one), for the checks below."""

    def __init__(self, engine=None):
        self.cu = testing()
        self.stream = self.cu.stream_create(DEVICE)
        self.engine = engine or self.cu.CopyEngine(DEVICE, kernel_images())
        self.live = []

    def alloc(self, data: bytes | int) -> int:
        size = data if isinstance(data, int) else len(data)
        p = self.cu.mem_alloc(DEVICE, max(size, 1))
        self.live.append(p)
        if not isinstance(data, int):
            self.cu.write(DEVICE, p, data)
        return p

    def read(self, p: int, n: int) -> bytes:
        self.cu.stream_synchronize(DEVICE, self.stream)
        return self.cu.read(DEVICE, p, n)

    def close(self):
        self.cu.stream_synchronize(DEVICE, self.stream)
        for p in self.live:
            self.cu.mem_free(DEVICE, p)
        self.cu.stream_destroy(DEVICE, self.stream)


def copies(cases: list[tuple[int, int, int]]) -> list[bool]:
    """copy() of (nbytes, dst offset, src offset) each, checked byte for byte."""
    dev, rng, out = Device(), np.random.default_rng(0), []
    for nbytes, dst_off, src_off in cases:
        src_bytes = rng.integers(0, 256, nbytes + 64, dtype=np.uint8).tobytes()
        src, dst = dev.alloc(src_bytes), dev.alloc(bytes(nbytes + 64))
        dev.engine.copy(dev.stream, dst + dst_off, src + src_off, nbytes)
        want = bytearray(nbytes + 64)
        want[dst_off : dst_off + nbytes] = src_bytes[src_off : src_off + nbytes]
        out.append(dev.read(dst, nbytes + 64) == bytes(want))
    dev.close()
    return out


def long_copies(cases: list[tuple]) -> tuple[list[bool], dict[str, int]]:
    """copies() of long ones (a fourth element True: by copy_kernel, the
    kernel whatever the length), and the engine's launches by kind after."""
    dev, rng, out = Device(), np.random.default_rng(2), []
    for nbytes, dst_off, src_off, *kernel in cases:
        src_bytes = rng.integers(0, 256, nbytes + 64, dtype=np.uint8).tobytes()
        src, dst = dev.alloc(src_bytes), dev.alloc(bytes(nbytes + 64))
        copy = dev.engine.copy_kernel if kernel and kernel[0] else dev.engine.copy
        copy(dev.stream, dst + dst_off, src + src_off, nbytes)
        want = bytearray(nbytes + 64)
        want[dst_off : dst_off + nbytes] = src_bytes[src_off : src_off + nbytes]
        out.append(dev.read(dst, nbytes + 64) == bytes(want))
    launches = dev.engine.launches()
    dev.close()
    return out, launches


def enqueue_gather(dev: Device, sizes: list[int], rng) -> tuple[list, bytes]:
    """Random tensors of `sizes` gathered into one new block by one
    copy_segments on dev's stream (not waited for): its rows and the bytes
    the block will hold."""
    datas = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    srcs = [dev.alloc(d) for d in datas]
    block = dev.alloc(sum(sizes) + 1)
    rows, offset = [], 0
    for p, n in zip(srcs, sizes):
        rows.append((block + offset, p, n))
        offset += n
    dev.engine.copy_segments(dev.stream, rows)
    return rows, b"".join(datas)


def gather(sizes: list[int], rounds: int = 1) -> tuple[bool, dict[str, int]]:
    """copy_segments of tensors of `sizes` into one block, `rounds` times
    (reusing the staging of the descriptor table), then scattered back out."""
    dev, rng, ok = Device(), np.random.default_rng(1), True
    for _ in range(rounds):
        rows, want = enqueue_gather(dev, sizes, rng)
        back = [dev.alloc(n) for n in sizes]
        dev.engine.copy_segments(
            dev.stream, [(b, dst, n) for b, (dst, _, n) in zip(back, rows)]
        )
        ok &= dev.read(rows[0][0], len(want)) == want
        got = b"".join(dev.read(b, n) for b, n in zip(back, sizes))
        ok &= got == want
    launches = dev.engine.launches()
    dev.close()
    return ok, launches


def strided(cases: list[tuple]) -> tuple[list[bool], dict[str, int]]:
    """pack then unpack of each (sizes, strides, elem_size, storage elements
    [, byte offset of the view]) view, against numpy's as_strided of the
    same bytes; and the engine's launches by kernel (and row copies)."""
    from numpy.lib.stride_tricks import as_strided

    dev, rng, out = Device(), np.random.default_rng(2), []
    pair = np.dtype([("lo", "<u8"), ("hi", "<u8")])
    dtypes = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: pair}
    for sizes, strides, elem, storage, *rest in cases:
        offset = rest[0] if rest else 0
        dtype = dtypes[elem]
        base = rng.integers(0, 256, storage * elem, dtype=np.uint8).view(dtype)
        view = as_strided(base, sizes, [s * elem for s in strides])
        want = np.ascontiguousarray(view).tobytes()
        src = dev.alloc(bytes(offset) + base.tobytes()) + offset
        packed = dev.alloc(max(len(want), 1))
        dev.engine.pack(dev.stream, packed, src, sizes, strides, elem)
        ok = dev.read(packed, len(want)) == want
        if 0 not in strides:
            target = dev.alloc(bytes(offset + storage * elem)) + offset
            dev.engine.unpack(dev.stream, target, packed, sizes, strides, elem)
            got = np.frombuffer(dev.read(target, storage * elem), dtype)
            got = as_strided(got, sizes, [s * elem for s in strides])
            ok &= np.ascontiguousarray(got).tobytes() == want
        out.append(bool(ok))
    launches = dev.engine.launches()
    dev.close()
    return out, launches


def concurrent_gathers(threads: int, rounds: int) -> tuple[bool, int]:
    """Threads sharing one engine, each gathering on a stream of its own
    with no synchronisation between rounds (so staging buffers are in flight
    together), checked at the end; and how many staging buffers it made."""
    from concurrent.futures import ThreadPoolExecutor

    engine = testing().CopyEngine(DEVICE, kernel_images())
    sizes = [3000 + 17 * i for i in range(64)]

    def run(seed: int) -> bool:
        dev, rng = Device(engine), np.random.default_rng(seed)
        checks = [enqueue_gather(dev, sizes, rng) for _ in range(rounds)]
        ok = all(dev.read(rows[0][0], len(want)) == want for rows, want in checks)
        dev.close()
        return ok

    with ThreadPoolExecutor(threads) as pool:
        ok = all(pool.map(run, range(threads)))
    return ok, engine.staging_buffers()


def fake_stats() -> dict | None:
    """The fake driver's counters (tests/cuda_fake), or None on a real one."""
    import ctypes
    import json

    path = os.environ.get("TORCH_RPC_EXT_LIBCUDA")
    if not path:
        return None
    testing().libcuda_description()  # loaded by the extension first
    lib = ctypes.CDLL(path)
    buf = ctypes.create_string_buffer(1 << 16)
    n = lib.fake_cuda_stats(buf, len(buf))
    return json.loads(buf.raw[:n])


def set_fake_kernel_delay(ms: int) -> None:
    """Kernels and asynchronous copies queued from now on run `ms` late (the
    fake driver only)."""
    import ctypes

    testing().libcuda_description()  # loaded by the extension first
    ctypes.CDLL(os.environ["TORCH_RPC_EXT_LIBCUDA"]).fake_cuda_set_kernel_delay_ms(
        ctypes.c_long(ms))


def set_fake_alloc_delay(ms: int) -> None:
    """cuMemAlloc returns `ms` late from now on (the fake driver only)."""
    import ctypes

    testing().libcuda_description()  # loaded by the extension first
    ctypes.CDLL(os.environ["TORCH_RPC_EXT_LIBCUDA"]).fake_cuda_set_alloc_delay_ms(
        ctypes.c_long(ms))


def engine_error(images: dict[str, tuple[str, str]]) -> str:
    try:
        testing().CopyEngine(DEVICE, images)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return ""


def merge_dims(sizes, strides):
    return testing().CopyEngine.merge_dims(sizes, strides)


def export_memory(conn, nbytes: int, pattern: bytes) -> None:
    """Creates memory, fills it, sends its fd to the peer on `conn`, then
    waits for the peer's word, checks what the peer wrote, and exits when
    told (the memory freed with it)."""
    cu = testing()
    mem = cu.ExportedMemory.create(DEVICE, nbytes)
    cu.write(DEVICE, mem.address, pattern)
    fd = mem.export_fd()
    conn.send((mem.size, cu.granularity(DEVICE)))
    peer_pid = conn.recv()
    reduction.send_handle(conn, fd, peer_pid)
    os.close(fd)
    conn.recv()  # the peer wrote
    conn.send(cu.read(DEVICE, mem.address, len(pattern)))
    conn.recv()  # exit now
    del mem


def import_memory(conn, ctl, pattern: bytes) -> None:
    cu = testing()
    size, granularity = conn.recv()
    conn.send(os.getpid())
    fd = reduction.recv_handle(conn)
    mem = cu.ExportedMemory.import_fd(fd, size, DEVICE)
    os.close(fd)
    seen = cu.read(DEVICE, mem.address, len(pattern))
    cu.write(DEVICE, mem.address, pattern[::-1])
    conn.send("wrote")
    from_owner = conn.recv()
    conn.send("exit")
    ctl.recv()  # the owner has exited
    after_exit = cu.read(DEVICE, mem.address, len(pattern))
    try:
        mem.export_fd()
        reexport = ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        reexport = str(e)
    ctl.send((size, granularity, seen, from_owner, after_exit, reexport))


def block_teardown_waits_off_thread(hold_s: float) -> tuple[float, dict | None, dict | None]:
    """A cuda_ipc block whose `released` event sits behind a stream held for
    `hold_s` (as a peer's record behind work that does not end) is let go:
    how long the drop took, and the fake's live device memory while the
    stream is held and once it was let through (None on a real driver)."""
    import threading
    import time

    cu = testing()
    stream = cu.stream_create(DEVICE)
    gate = cu.gate_stream(DEVICE, stream)
    opener = threading.Timer(hold_s, cu.open_gate, args=(gate,))
    opener.start()
    took = cu.drop_ipc_block_released_on(DEVICE, 2 << 20, stream)
    held = fake_stats()
    opener.join()
    cu.stream_synchronize(DEVICE, stream)
    after = fake_stats()
    deadline = time.monotonic() + 10
    while after is not None and after["live"]["vmm_handles"] and time.monotonic() < deadline:
        time.sleep(0.05)
        after = fake_stats()
    cu.stream_destroy(DEVICE, stream)
    return took, held and held["live"], after and after["live"]


def peer_leases_release_apart(shared_join: bool, wait_s: float) -> tuple[bool, bool]:
    """Two connections' leases on blocks of cuda:0 read from cuda:1, the
    first's use held at a gate (a peer's `ready` that never completes):
    whether each block's `released` completed within `wait_s`, with each
    connection's own join stream, or (`shared_join`) one stream for both, as
    one per device for the whole process was. Sets two fake devices: call in
    a process whose driver is not loaded yet, or on two GPUs."""
    os.environ.setdefault("FAKE_CUDA_DEVICES", "2")
    cu = testing()
    held = cu.stream_create(1)
    gate = cu.gate_stream(1, held)
    joins = [cu.stream_create(0)]
    if not shared_join:
        joins.append(cu.stream_create(0))
    try:
        return cu.peer_leases_released(0, 1, held, joins[0], joins[-1], wait_s)
    finally:
        cu.open_gate(gate)
        cu.stream_synchronize(1, held)
        cu.stream_destroy(1, held)
        for join in joins:
            cu.stream_synchronize(0, join)
            cu.stream_destroy(0, join)


def export_legacy(conn, nbytes: int) -> None:
    """Makes `nbytes` of memory shared by legacy handle, sends the handle on
    `conn`, and keeps it until told to exit."""
    cu = testing()
    mem = cu.ExportedMemory.create_legacy(DEVICE, nbytes)
    conn.send((mem.size, mem.legacy_handle()))
    conn.recv()  # exit now
    del mem


def import_legacy(conn, ctl, claims) -> None:
    """Opens the handle the owner sent as each size of `claims`; reports
    (size opened or the error's text) for each."""
    cu = testing()
    size, handle = conn.recv()
    out = []
    for claim in claims:
        try:
            mem = cu.ExportedMemory.import_legacy(handle, claim(size), DEVICE)
            out.append(mem.size)
            del mem
        except Exception as e:  # noqa: BLE001 - the message is the result
            out.append(f"{type(e).__name__}: {e}")
    conn.send("exit")
    ctl.send((size, out))
