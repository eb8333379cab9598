# SPDX-License-Identifier: BSD-3-Clause
"""Hardware probe for the copy kernels and CUDA IPC, run on a GPU machine.

Loads the kernels' PTX through the driver API (ctypes over libcuda, the way
the C++ channel does), runs each on real device memory against torch's own
copies, times them next to torch's, and checks what the cuda_ipc channel
relies on: a memory handle and an interprocess event opened by a second
process, the base/offset arithmetic for sub-allocated tensors, and what
cuIpcGetMemHandle says about expandable segments. Prints one JSON object per
line; exits 1 if any check fails.

Usage: python tools/gpu_probe.py --ptx DIR   (DIR from `python -m
torch_rpc_ext._cuda.ptx --out DIR`)
"""

import argparse
import ctypes
import json
import multiprocessing as mp
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


class Driver:
    """The few libcuda entry points the probe uses, raising on any error."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check(self.lib.cuInit(0), "cuInit")

    def check(self, rc, what):
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"{what}: CUDA error {rc} ({text.value.decode()})")

    def load(self, ptx_dir):
        manifest = json.loads((ptx_dir / "kernels.json").read_text())
        functions = {}
        for k in manifest["kernels"]:
            module = ctypes.c_void_p()
            text = (ptx_dir / k["file"]).read_bytes() + b"\0"
            self.check(
                self.lib.cuModuleLoadData(ctypes.byref(module), text),
                f"cuModuleLoadData({k['name']})",
            )
            fn = ctypes.c_void_p()
            self.check(
                self.lib.cuModuleGetFunction(
                    ctypes.byref(fn), module, k["entry"].encode()
                ),
                f"cuModuleGetFunction({k['name']})",
            )
            functions[k["name"]] = fn
        return functions

    def launch(self, fn, grid, block, args, stream=None):
        values = [ctypes.c_uint64(a) for a in args]
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values]
        )
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        self.check(
            self.lib.cuLaunchKernel(
                fn, grid, 1, 1, block, 1, 1, 0, ctypes.c_void_p(stream), params, None
            ),
            "cuLaunchKernel",
        )


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def sm_count():
    return torch.cuda.get_device_properties(0).multi_processor_count


def check_contiguous(drv, fns):
    for nbytes, dst_off, src_off in [
        (0, 0, 0), (1, 0, 0), (15, 1, 3), (16, 0, 0), (17, 16, 16), (4097, 5, 5),
        (1 << 20, 0, 0), ((1 << 20) + 3, 7, 2), (64 << 20, 0, 0),
    ]:
        src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros(nbytes + 64, dtype=torch.uint8, device="cuda")
        drv.launch(fns["copy_contiguous"], sm_count() * 4, 256,
                   [dst.data_ptr() + dst_off, src.data_ptr() + src_off, nbytes])
        want = torch.zeros_like(dst)
        want[dst_off:dst_off + nbytes] = src[src_off:src_off + nbytes]
        ok = torch.equal(dst, want)
        emit(check="copy_contiguous", nbytes=nbytes, dst_off=dst_off,
             src_off=src_off, ok=ok)


def check_segments(drv, fns):
    from torch_rpc_ext._cuda import abi

    sizes = [0, 1, 100, 4096, 12345, 1 << 20, 3 << 20, 7]
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for n in sizes]
    slab = torch.zeros(sum(sizes) + 16 * len(sizes), dtype=torch.uint8, device="cuda")
    segments, offset = [], 0
    for s in srcs:
        segments.append((slab.data_ptr() + offset, s.data_ptr(), s.numel()))
        offset += s.numel() + 16
    chunk = 64 << 10
    table = torch.from_numpy(abi.segment_table(segments, chunk).view("int64")).cuda()
    drv.launch(fns["copy_segments"], sm_count() * 4, 256,
               [table.data_ptr(), len(segments), chunk])
    offset, ok = 0, True
    for s in srcs:
        ok &= torch.equal(slab[offset:offset + s.numel()], s)
        offset += s.numel() + 16
    emit(check="copy_segments", rows=len(sizes), ok=bool(ok))


def check_strided(drv, fns):
    from torch_rpc_ext._cuda import abi

    cases = [
        (torch.float32, lambda t: t.t(), (513, 257)),
        (torch.float16, lambda t: t[:, ::3], (64, 99)),
        (torch.float64, lambda t: t.permute(2, 0, 1), (5, 6, 7)),
        (torch.int8, lambda t: t[1:, 2:].t(), (33, 65)),
        (torch.complex128, lambda t: t.t(), (9, 11)),
        (torch.float32, lambda t: t.expand(4, -1, -1), (1, 30, 40)),
    ]
    for dtype, view_of, shape in cases:
        base = torch.randn(shape, dtype=torch.float64, device="cuda").to(dtype)
        view = view_of(base)
        desc = torch.from_numpy(
            abi.strided_descriptor(view.shape, view.stride(), view.element_size())
            .view("int64")
        ).cuda()
        packed = torch.empty(view.numel(), dtype=dtype, device="cuda")
        drv.launch(fns["pack_strided"], sm_count() * 4, 256,
                   [packed.data_ptr(), view.data_ptr(), desc.data_ptr()])
        ok_pack = torch.equal(packed, view.contiguous().view(-1))
        ok_unpack = True
        if 0 not in view.stride():
            target = torch.zeros_like(base)
            tview = view_of(target)
            drv.launch(fns["unpack_strided"], sm_count() * 4, 256,
                       [tview.data_ptr(), packed.data_ptr(), desc.data_ptr()])
            ok_unpack = torch.equal(tview, view)
        emit(check="strided", dtype=str(dtype), shape=list(view.shape),
             stride=list(view.stride()), ok=bool(ok_pack and ok_unpack))


def timed(fn, repeat):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat / 1e3  # seconds


def bench(drv, fns):
    sms = sm_count()
    for nbytes in (4 << 10, 1 << 20, 64 << 20, 1 << 30):
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        repeat = 200 if nbytes <= (1 << 20) else 20
        for blocks, threads in ((sms * 2, 256), (sms * 4, 512), (sms * 8, 256)):
            t = timed(partial(drv.launch, fns["copy_contiguous"], blocks, threads,
                              [dst.data_ptr(), src.data_ptr(), nbytes]), repeat)
            emit(bench="copy_contiguous", nbytes=nbytes, grid=blocks, block=threads,
                 us=round(t * 1e6, 2), gbps_rw=round(2 * nbytes / t / 1e9, 1))
        t = timed(partial(dst.copy_, src), repeat)
        emit(bench="torch_copy_", nbytes=nbytes, us=round(t * 1e6, 2),
             gbps_rw=round(2 * nbytes / t / 1e9, 1))
    x = torch.randn(8192, 8192, device="cuda")
    v = x.t()
    desc = torch.from_numpy(__import__("torch_rpc_ext._cuda.abi", fromlist=["x"])
                            .strided_descriptor(v.shape, v.stride(), 4).view("int64")).cuda()
    out = torch.empty(v.numel(), device="cuda")
    t = timed(lambda: drv.launch(fns["pack_strided"], sms * 8, 256,
                                 [out.data_ptr(), v.data_ptr(), desc.data_ptr()]), 10)
    emit(bench="pack_strided_transpose_fp32", nbytes=v.numel() * 4, us=round(t * 1e6, 1),
         gbps_rw=round(2 * v.numel() * 4 / t / 1e9, 1))
    t = timed(lambda: v.contiguous(), 10)
    emit(bench="torch_contiguous_transpose_fp32", nbytes=v.numel() * 4,
         us=round(t * 1e6, 1), gbps_rw=round(2 * v.numel() * 4 / t / 1e9, 1))


def _ipc_child(conn, ptx_dir):
    try:
        torch.cuda.init()
        torch.empty(1, device="cuda")
        drv = Driver()
        fns = drv.load(Path(ptx_dir))
        handle_bytes, event_bytes, offset, nbytes, checksum = conn.recv()
        handle = IpcMemHandle()
        ctypes.memmove(ctypes.byref(handle), handle_bytes, 64)
        base = ctypes.c_uint64()
        drv.lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                  IpcMemHandle, ctypes.c_uint]
        t0 = time.perf_counter()
        drv.check(drv.lib.cuIpcOpenMemHandle_v2(ctypes.byref(base), handle, 1),
                  "cuIpcOpenMemHandle")
        open_s = time.perf_counter() - t0
        ev_handle = (ctypes.c_char * 64).from_buffer_copy(event_bytes)
        event = ctypes.c_void_p()

        class EvHandle(ctypes.Structure):
            _fields_ = [("reserved", ctypes.c_char * 64)]

        drv.lib.cuIpcOpenEventHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), EvHandle]
        eh = EvHandle()
        ctypes.memmove(ctypes.byref(eh), bytes(ev_handle), 64)
        drv.check(drv.lib.cuIpcOpenEventHandle(ctypes.byref(event), eh),
                  "cuIpcOpenEventHandle")
        stream = torch.cuda.current_stream().cuda_stream
        drv.check(drv.lib.cuStreamWaitEvent(ctypes.c_void_p(stream), event, 0),
                  "cuStreamWaitEvent")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        sms = sm_count()
        drv.launch(fns["copy_contiguous"], sms * 4, 512,
                   [dst.data_ptr(), base.value + offset, nbytes])
        torch.cuda.synchronize()
        got = int(dst[:4096].to(torch.int64).sum().item())
        t = timed(lambda: drv.launch(fns["copy_contiguous"], sms * 4, 512,
                                     [dst.data_ptr(), base.value + offset, nbytes]), 20)
        drv.check(drv.lib.cuIpcCloseMemHandle(ctypes.c_uint64(base.value)),
                  "cuIpcCloseMemHandle")
        conn.send(("ok", got == checksum, open_s, t))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def check_ipc(drv, ptx_dir):
    nbytes = 256 << 20
    # A tensor inside a bigger caching-allocator block: its handle names the
    # block, and the opener adds the offset.
    block = torch.empty(nbytes + (2 << 20), dtype=torch.uint8, device="cuda")
    src = block[4096:4096 + nbytes]
    src.random_(0, 256)
    torch.cuda.synchronize()
    handle = IpcMemHandle()
    drv.check(drv.lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(src.data_ptr())),
              "cuIpcGetMemHandle")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    drv.check(drv.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                              ctypes.c_uint64(src.data_ptr())),
              "cuMemGetAddressRange")
    offset = src.data_ptr() - base.value
    event = ctypes.c_void_p()
    drv.check(drv.lib.cuEventCreate(ctypes.byref(event), 0x2 | 0x4), "cuEventCreate")
    drv.check(drv.lib.cuEventRecord(event, ctypes.c_void_p(
        torch.cuda.current_stream().cuda_stream)), "cuEventRecord")
    ev_handle = (ctypes.c_char * 64)()
    drv.check(drv.lib.cuIpcGetEventHandle(ev_handle, event), "cuIpcGetEventHandle")
    checksum = int(src[:4096].to(torch.int64).sum().item())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_child, args=(child, str(ptx_dir)))
    proc.start()
    parent.send((ctypes.string_at(ctypes.byref(handle), 64), bytes(ev_handle),
                 offset, nbytes, checksum))
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
    emit(check="ipc", ok=bool(same), base_offset=offset, allocation=size.value,
         open_ms=round(open_s * 1e3, 2))
    emit(bench="ipc_copy_contiguous_peer_to_own", nbytes=nbytes, us=round(t * 1e6, 1),
         gbps_rw=round(2 * nbytes / t / 1e9, 1))


def check_expandable(drv):
    """Whether cuIpcGetMemHandle works on an expandable-segments tensor."""
    code = r"""
import ctypes, torch
torch.cuda.memory._set_allocator_settings("expandable_segments:True")
t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
lib = ctypes.CDLL("libcuda.so.1")
h = (ctypes.c_char * 64)()
print(lib.cuIpcGetMemHandle(h, ctypes.c_uint64(t.data_ptr())))
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    emit(check="expandable_segments_ipc_handle", rc=out.stdout.strip(),
         stderr=out.stderr[-400:])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ptx", type=Path, required=True)
    args = parser.parse_args()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    props = torch.cuda.get_device_properties(0)
    emit(device=props.name, sms=props.multi_processor_count, cc=[props.major, props.minor],
         torch=torch.__version__, cuda=torch.version.cuda)
    drv = Driver()
    fns = drv.load(args.ptx)
    emit(check="ptx_loaded", kernels=sorted(fns), ok=True)
    for step in (check_contiguous, check_segments, check_strided, bench):
        try:
            step(drv, fns)
        except Exception:
            emit(check=step.__name__, ok=False, error=traceback.format_exc())
        torch.cuda.synchronize()
    for step in (lambda: check_ipc(drv, args.ptx), lambda: check_expandable(drv)):
        try:
            step()
        except Exception:
            emit(check="ipc", ok=False, error=traceback.format_exc())
    emit(summary="gpu_probe", failures=len(_failures))
    sys.exit(1 if _failures else 0)


if __name__ == "__main__":
    main()
