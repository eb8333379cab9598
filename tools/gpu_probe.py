# SPDX-License-Identifier: BSD-3-Clause
"""Hardware probe for the copy engine and CUDA IPC, run on a GPU machine by
tools/gpu_check.sh (after the in-place build, with the test hooks).

Correctness of the kernels and the engine on the real driver is
tests/cuda_driver's (gpu_check.sh runs it). This times the C++ copy engine
(torch_rpc_ext._testing.cuda.CopyEngine) on torch's memory and stream next to
torch's own copies, and checks what the cuda_ipc channel will rely on beyond
its fd-exported memory: a legacy memory handle of a sub-allocated tensor and
an interprocess event opened by a second process (whose stream waits on the
event, then copies from the mapping with the engine), and what
cuIpcGetMemHandle says about expandable segments. Prints one JSON object per
line; exits 1 if any check fails.

Usage: python tools/gpu_probe.py --ptx DIR   (DIR from `python -m
torch_rpc_ext._cuda.ptx --out DIR`)
"""

import argparse
import ctypes
import json
import multiprocessing as mp
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

_failures = []


def emit(**row):
    print(json.dumps(row), flush=True)
    if row.get("ok") is False:
        _failures.append(row)


def engine(ptx_dir: Path):
    """The C++ copy engine of device 0, loaded from the PTX folder."""
    from torch_rpc_ext import _testing

    manifest = json.loads((ptx_dir / "kernels.json").read_text())
    images = {
        k["name"]: (k["entry"], (ptx_dir / k["file"]).read_text())
        for k in manifest["kernels"]
    }
    return _testing.cuda.CopyEngine(0, images)


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def timed(fn, repeat):
    """(GPU seconds, host seconds, hidden) per call of fn. The GPU's: between two
    events around `repeat` calls queued behind a sleeping kernel, so that
    the host's enqueueing is hidden and the events time the device's work
    alone (until session 58 the host's time per call was in it too, and a
    call whose host side is slow, a table of 1000 rows made per call, read
    as a slow kernel). The host's: the same calls timed on the host."""
    fn()
    torch.cuda.synchronize()
    # Once behind a sleep first: what a call takes from a pool that grows
    # while the device is busy (the engine's staging for its tables, one a
    # call in flight) is made here, not in the timed passes.
    torch.cuda._sleep(int(0.2 * 2e9))
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    host = (time.perf_counter() - t0) / repeat
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # Twice the enqueueing's time at 2 GHz (about the H100's and H200's
    # clock; a slower clock sleeps longer), and 1 ms at least.
    torch.cuda._sleep(int(max(2 * host * repeat, 1e-3) * 2e9))
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    # Still asleep once everything is queued: the events time the device.
    hidden = not start.query()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat / 1e3, host, hidden


def row(bench, nbytes, t, **extra):
    """t: timed()'s (GPU seconds, host seconds, hidden). `hidden` false:
    the device reached the calls before the host had queued them all, so
    `us` is partly the host's."""
    gpu, host, hidden = t
    emit(bench=bench, nbytes=nbytes, us=round(gpu * 1e6, 2),
         gbps_rw=round(2 * nbytes / gpu / 1e9, 1), host_us=round(host * 1e6, 2),
         hidden=hidden, **extra)


def bench(eng):
    for nbytes in (4 << 10, 64 << 10, 4 << 20, 32 << 20, 400 << 20):
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        repeat = 200 if nbytes <= (4 << 20) else 20
        before = eng.launches()["driver_copies"]
        t = timed(partial(eng.copy, stream(), dst.data_ptr(), src.data_ptr(), nbytes),
                  repeat)
        # From some length on (session 58: 8 MiB) the engine's plain copy is
        # the driver's; the kernel is timed there too, to say where the two
        # cross.
        driver = eng.launches()["driver_copies"] > before
        row("engine_copy", nbytes, t, path="driver" if driver else "kernel")
        if driver:
            row("engine_kernel_copy", nbytes, timed(
                partial(eng.copy_kernel, stream(), dst.data_ptr(), src.data_ptr(), nbytes),
                repeat))
        row("torch_copy_", nbytes, timed(partial(dst.copy_, src), repeat))
    for count, each in ((256, 16 << 10), (1000, 1 << 10)):
        srcs = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
        block = torch.empty(count * each, dtype=torch.uint8, device="cuda")
        rows = [(block.data_ptr() + i * each, s.data_ptr(), each) for i, s in enumerate(srcs)]
        row("engine_copy_segments", count * each,
            timed(partial(eng.copy_segments, stream(), rows), 50), tensors=count)
        row("torch_cat", count * each, timed(partial(torch.cat, srcs), 50), tensors=count)
    x = torch.randn(4096, 4096, device="cuda")
    v = x[::2]  # every other row: 32 MB of a 64 MB tensor
    out = torch.empty(v.numel(), device="cuda")
    t = timed(partial(eng.pack, stream(), out.data_ptr(), v.data_ptr(), list(v.shape),
                      list(v.stride()), 4), 20)
    # Rows of 16 KB: one pitched copy (cuMemcpy2DAsync) since issue 46.
    row("engine_pack_every_other_row", v.numel() * 4, t,
        path="row_copy" if eng.launches().get("row_copies") else "kernel")
    row("torch_contiguous_every_other_row", v.numel() * 4,
        timed(partial(v.contiguous), 20))
    w = x[:, ::2]  # every other column: the strided kernel
    t = timed(partial(eng.pack, stream(), out.data_ptr(), w.data_ptr(), list(w.shape),
                      list(w.stride()), 4), 20)
    row("engine_pack_every_other_column", w.numel() * 4, t)
    row("torch_contiguous_every_other_column", w.numel() * 4,
        timed(partial(w.contiguous), 20))


class Handle(ctypes.Structure):  # CUipcMemHandle and CUipcEventHandle: 64 bytes
    _fields_ = [("reserved", ctypes.c_char * 64)]


def libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), Handle,
                                          ctypes.c_uint]
    lib.cuIpcOpenEventHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), Handle]
    return lib


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def _ipc_child(conn, ptx_dir):
    try:
        torch.empty(1, device="cuda")  # the primary context, current here
        lib, eng = libcuda(), engine(Path(ptx_dir))
        mem, ev, offset, nbytes, checksum = conn.recv()
        base, event = ctypes.c_uint64(), ctypes.c_void_p()
        t0 = time.perf_counter()
        check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(base), Handle.from_buffer_copy(mem), 1),
              "cuIpcOpenMemHandle")
        open_s = time.perf_counter() - t0
        check(lib.cuIpcOpenEventHandle(ctypes.byref(event), Handle.from_buffer_copy(ev)),
              "cuIpcOpenEventHandle")
        check(lib.cuStreamWaitEvent(ctypes.c_void_p(stream()), event, 0), "cuStreamWaitEvent")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        # The kernel over the legacy mapping, as a message of several
        # segments still reads one (copy() would hand 256 MiB to the driver).
        eng.copy_kernel(stream(), dst.data_ptr(), base.value + offset, nbytes)
        got = int(dst[:4096].to(torch.int64).sum().item())
        t = timed(partial(eng.copy_kernel, stream(), dst.data_ptr(), base.value + offset,
                          nbytes), 20)
        check(lib.cuIpcCloseMemHandle(ctypes.c_uint64(base.value)), "cuIpcCloseMemHandle")
        conn.send(("ok", got == checksum, open_s, t))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def check_ipc(ptx_dir):
    lib = libcuda()
    nbytes = 256 << 20
    # A tensor inside a bigger caching-allocator block: its handle names the
    # block, and the opener adds the offset.
    block = torch.empty(nbytes + (2 << 20), dtype=torch.uint8, device="cuda")
    src = block[4096:4096 + nbytes]
    src.random_(0, 256)
    mem, ev = Handle(), Handle()
    check(lib.cuIpcGetMemHandle(ctypes.byref(mem), ctypes.c_uint64(src.data_ptr())),
          "cuIpcGetMemHandle")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                      ctypes.c_uint64(src.data_ptr())), "cuMemGetAddressRange")
    event = ctypes.c_void_p()
    check(lib.cuEventCreate(ctypes.byref(event), 0x2 | 0x4), "cuEventCreate")  # timing off, IPC
    check(lib.cuEventRecord(event, ctypes.c_void_p(stream())), "cuEventRecord")
    check(lib.cuIpcGetEventHandle(ctypes.byref(ev), event), "cuIpcGetEventHandle")
    checksum = int(src[:4096].to(torch.int64).sum().item())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_child, args=(child, str(ptx_dir)))
    proc.start()
    # (c_char arrays read as bytes stop at the first zero: copy all 64.)
    parent.send((ctypes.string_at(ctypes.byref(mem), 64),
                 ctypes.string_at(ctypes.byref(ev), 64),
                 src.data_ptr() - base.value, nbytes, checksum))
    if not parent.poll(120):
        proc.kill()
        emit(check="ipc", ok=False, error="child gave no answer in 120 s")
        return
    answer = parent.recv()
    proc.join(30)
    if answer[0] == "error":
        emit(check="ipc", ok=False, error=answer[1])
        return
    _, same, open_s, t = answer
    emit(check="ipc", ok=bool(same), base_offset=src.data_ptr() - base.value,
         allocation=size.value, open_ms=round(open_s * 1e3, 2))
    row("ipc_engine_copy_peer_to_own", nbytes, t)


def check_expandable():
    """What cuIpcGetMemHandle returns for an expandable-segments tensor."""
    code = r"""
import ctypes, torch
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
h = (ctypes.c_char * 64)()
print(ctypes.CDLL("libcuda.so.1").cuIpcGetMemHandle(h, ctypes.c_uint64(t.data_ptr())))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    emit(check="expandable_segments_ipc_handle", rc=out.stdout.strip(),
         stderr=out.stderr[-400:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ptx", type=Path, required=True)
    args = parser.parse_args()
    torch.empty(1, device="cuda")
    props = torch.cuda.get_device_properties(0)
    emit(device=props.name, sms=props.multi_processor_count, cc=[props.major, props.minor],
         torch=torch.__version__, cuda=torch.version.cuda)
    for name, step in (("bench", lambda: bench(engine(args.ptx))),
                       ("ipc", lambda: check_ipc(args.ptx)),
                       ("expandable", check_expandable)):
        try:
            step()
        except Exception:
            emit(check=name, ok=False, error=traceback.format_exc())
    emit(summary="gpu_probe", failures=len(_failures))
    sys.exit(1 if _failures else 0)


if __name__ == "__main__":
    main()
