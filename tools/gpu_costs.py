# SPDX-License-Identifier: BSD-3-Clause
"""What the pieces of a CUDA RPC cost on this machine's GPU and CPUs (issue
46): the host-side price of each driver and torch operation a CUDA message
makes, the machine's wake-up latency, and what an interprocess event adds to
a hop between two processes. Torch and the driver only (ctypes): nothing of
torch_rpc_ext is built or loaded, so it runs on a bare GPU machine at once.

The GPU run of 2026-11-27 (docs/gpu-runs/2026-11-27-h200/) found a 4 KB
CUDA round trip ~250-300 us dearer than a CPU one, spread evenly over the
call's hand-offs (benchmarks/cuda_call_breakdown.py); these rows say which
primitives can explain that and which cannot.

A hop: this process copies 4 KB on the GPU and records an interprocess
event (where the mode uses one), sends a byte over a pipe; the other
process does what HOPS says, copies 4 KB itself, synchronises its stream
and answers (`other_only`: only the other side uses the GPU, the control
for two contexts taking turns). On one GPU the
two processes' contexts share it: a stream of one waiting on the other's
event costs what no host-side primitive does (the H200, 2026-11-27: 302 us
a hop against a 32 us pipe round trip), and the modes say how much of it a
host-side wait would save. Under MPS (one context for both) the same hop
cost 83-87 us (2026-11-27b). The last three modes ask whether a side
that holds a context but submits no GPU work (waiting on the host, or only
a stream wait) escapes the turns: a receiver that does not land the bytes
itself could then cost a hop what one context does.

One JSON object per line: {"op": ..., "us": median per operation}.

    python tools/gpu_costs.py [--n 3000] [--hops-only]
"""

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import time

import torch
from gpu_probe import Handle, check, libcuda  # tools/: this script's folder

DISABLE_TIMING, INTERPROCESS = 0x2, 0x4


def driver():
    """libcuda.so.1 as tools/gpu_probe.py opens it, with the argument types
    of the calls timed here."""
    cu = libcuda()
    p = ctypes.c_void_p
    cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(p)]
    cu.cuEventCreate.argtypes = [ctypes.POINTER(p), ctypes.c_uint]
    cu.cuEventDestroy_v2.argtypes = [p]
    cu.cuEventRecord.argtypes = [p, p]
    cu.cuEventQuery.argtypes = [p]
    cu.cuStreamWaitEvent.argtypes = [p, p, ctypes.c_uint]
    cu.cuStreamSynchronize.argtypes = [p]
    cu.cuEventSynchronize.argtypes = [p]
    cu.cuIpcGetEventHandle.argtypes = [ctypes.POINTER(Handle), p]
    return cu


def event(cu, flags):
    e = ctypes.c_void_p()
    check(cu.cuEventCreate(ctypes.byref(e), flags), "cuEventCreate")
    return e


def per_op(fn, n, batch=50):
    """Median us per call of fn over batches of `batch` calls."""
    for _ in range(batch):
        fn()
    samples = []
    for _ in range(max(1, n // batch)):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - t0) / batch / 1e3)
    torch.cuda.synchronize()
    return round(statistics.median(samples), 2)


def emit(op, us, **more):
    print(json.dumps({"op": op, "us": us, **more}), flush=True)


def host_costs(n):
    cu = driver()
    x = torch.rand(1024, device="cuda")  # the primary context, current here
    y = torch.empty_like(x)
    side = torch.cuda.Stream()
    s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    s2 = ctypes.c_void_p(side.cuda_stream)
    ctx = ctypes.c_void_p()
    emit("ctypes_cuCtxGetCurrent (the ctypes floor)",
         per_op(lambda: cu.cuCtxGetCurrent(ctypes.byref(ctx)), n))

    def create_destroy(flags):
        def fn():
            e = ctypes.c_void_p()
            cu.cuEventCreate(ctypes.byref(e), flags)
            cu.cuEventDestroy_v2(e)
        return fn

    emit("cuEventCreate+cuEventDestroy", per_op(create_destroy(DISABLE_TIMING), n))
    emit("cuEventCreate+cuEventDestroy interprocess",
         per_op(create_destroy(DISABLE_TIMING | INTERPROCESS), n))
    plain, ipc = event(cu, DISABLE_TIMING), event(cu, DISABLE_TIMING | INTERPROCESS)
    emit("cuEventRecord", per_op(lambda: cu.cuEventRecord(plain, s), n))
    emit("cuEventRecord interprocess", per_op(lambda: cu.cuEventRecord(ipc, s), n))
    emit("cuEventQuery (completed)", per_op(lambda: cu.cuEventQuery(plain), n))
    emit("cuStreamWaitEvent", per_op(lambda: cu.cuStreamWaitEvent(s2, plain, 0), n))
    emit("cuStreamWaitEvent interprocess (own)",
         per_op(lambda: cu.cuStreamWaitEvent(s2, ipc, 0), n))
    emit("torch copy_ 4KB (launch only)", per_op(lambda: y.copy_(x), n))
    emit("torch copy_ 4KB + synchronize", per_op(
        lambda: (y.copy_(x), torch.cuda.synchronize()), n))
    emit("torch.cuda.synchronize (idle)", per_op(torch.cuda.synchronize, n))
    emit("torch.cuda.current_stream()", per_op(torch.cuda.current_stream, n))

    def alloc():
        t = torch.empty(1024, device="cuda")
        del t

    def alloc_recorded():
        t = torch.empty(1024, device="cuda")
        t.record_stream(side)
        del t

    emit("torch.empty 4KB + free (cached)", per_op(alloc, n))
    emit("torch.empty 4KB + record_stream(other) + free", per_op(alloc_recorded, n))

    def torch_event():
        e = torch.cuda.Event()
        e.record()
        e.wait(side)

    emit("torch.cuda.Event() + record + wait(other)", per_op(torch_event, n))

    def future(devices):
        def fn():
            f = torch.futures.Future(devices=devices)
            f.set_result(x)
            f.wait()
        return fn

    emit("torch Future set_result + wait, CPU future", per_op(future(None), n))
    emit("torch Future set_result + wait, devices=[cuda:0]", per_op(future(["cuda:0"]), n))

    def future_then():
        f = torch.futures.Future(devices=["cuda:0"])
        child = f.then(lambda f: f.value())
        f.set_result(x)
        child.wait()

    emit("torch Future(cuda) .then + set_result + wait", per_op(future_then, n))

    def stream_context():
        with torch.cuda.stream(side):
            pass

    emit("torch.cuda.stream(side) enter+exit", per_op(stream_context, n))


HOPS = {
    # mode: what the other process does after the byte arrives, before its
    # own 4 KB copy and stream sync (where it uses CUDA); this one copies
    # 4 KB first wherever it uses CUDA, and records the interprocess event
    # where the other side uses it
    "blocking": "nothing, and no CUDA on either side (the wake-up floor)",
    "spinning": "nothing, no CUDA, spinning on the pipe (this side blocks)",
    "other_only": "its copy and sync; this side no CUDA (one context uses the GPU)",
    "no_dependency": "nothing: both use the GPU, neither waits for the other",
    "stream_wait": "its stream waits on the event (cuStreamWaitEvent; what cuda_ipc does)",
    "host_sync": "its thread waits on the event (cuEventSynchronize)",
    "query_poll": "its thread polls the event (cuEventQuery) until done",
    "sender_sync": "nothing; this side synchronises its stream before sending",
    # Does a side that submits no GPU work of its own escape the two
    # contexts' turns? (A receiver that only waits on the host could; one
    # that lands the bytes itself cannot.) The other side holds a context
    # and its memory in all three, as a worker would.
    "other_idle": "nothing on the GPU (a context, no work); this side synchronises before sending",
    "host_wait_only": "its thread waits on the event (cuEventSynchronize), no GPU work of its own",
    "stream_wait_only": "its stream waits on the event and it synchronises that stream, no copy",
    # Do copies by the copy engines (between pinned host memory and the
    # device: staging's copies) take turns as copies by the SMs do? This
    # side copies its 4 KB device to pinned host, the other pinned host to
    # device (session 64: whether a small staged message escapes the turns).
    "ce_no_dependency": "its copy is host to device (copy engine), as ours is device to host; no wait",
    "ce_stream_wait": "its stream waits on the event, then copies host to device (copy engine)",
}
# Modes in which neither side uses the GPU.
_NO_CUDA = ("blocking", "spinning")
_EVENT = ("stream_wait", "host_sync", "query_poll", "host_wait_only", "stream_wait_only",
          "ce_stream_wait")
# Modes whose copies are between pinned host memory and the device.
_COPY_ENGINE = ("ce_no_dependency", "ce_stream_wait")
# Modes in which the other side copies nothing (it may still wait).
_OTHER_IDLE = ("other_idle", "host_wait_only", "stream_wait_only")
# Modes in which this side synchronises its stream before sending.
_SENDER_SYNC = ("sender_sync", "other_idle")
NOT_READY = 600  # CUDA_ERROR_NOT_READY


def _pong(conn, mode):
    """The other end of a hop: answers each byte, after what HOPS says."""
    import torch as t  # noqa: F401  (spawned: import anew)

    msg = conn.recv()
    cuda = mode not in _NO_CUDA
    if cuda:
        cu = driver()
        y = t.empty(1024, device="cuda")
        x = t.empty(1024, pin_memory=True) if mode in _COPY_ENGINE else \
            t.empty(1024, device="cuda")
        s = ctypes.c_void_p(t.cuda.current_stream().cuda_stream)
    ev = None
    if msg is not None:
        ev = ctypes.c_void_p()
        t0 = time.perf_counter_ns()
        check(cu.cuIpcOpenEventHandle(ctypes.byref(ev), Handle.from_buffer_copy(msg)),
              "cuIpcOpenEventHandle")
        conn.send((time.perf_counter_ns() - t0) / 1e3)
    while True:
        if mode == "spinning":
            while not conn.poll(0):
                pass
        b = conn.recv()
        if b is None:
            break
        if mode in ("stream_wait", "stream_wait_only", "ce_stream_wait"):
            check(cu.cuStreamWaitEvent(s, ev, 0), "cuStreamWaitEvent")
        elif mode in ("host_sync", "host_wait_only"):
            check(cu.cuEventSynchronize(ev), "cuEventSynchronize")
        elif mode == "query_poll":
            while (rc := cu.cuEventQuery(ev)) == NOT_READY:
                pass
            check(rc, "cuEventQuery")
        if cuda and mode not in _OTHER_IDLE:
            y.copy_(x, non_blocking=True)  # (host to device from pinned: async)
        if cuda and mode != "host_wait_only" and mode != "other_idle":
            check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
        conn.send(b)


def _answer(conn, p, timeout=60):
    """The other side's next message; an error, not a hang, if it died."""
    if not conn.poll(timeout):
        raise RuntimeError(f"the other process sent nothing in {timeout} s "
                           f"(alive: {p.is_alive()}, exit code {p.exitcode})")
    return conn.recv()


def ping_pongs(n):
    ctx = mp.get_context("spawn")
    for mode, label in HOPS.items():
        a, b = ctx.Pipe()
        p = ctx.Process(target=_pong, args=(b, mode))
        p.start()
        b.close()  # ours: the child's end only in the child, so its death is an EOF
        extra = {}
        cuda = mode not in _NO_CUDA and mode != "other_only"
        event_used = mode in _EVENT
        if cuda:
            cu = driver()
            x = torch.rand(1024, device="cuda")
            y = torch.empty(1024, pin_memory=True) if mode in _COPY_ENGINE else \
                torch.empty_like(x)
            s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        ev = None
        try:
            if event_used:
                ev = event(cu, DISABLE_TIMING | INTERPROCESS)
                h = Handle()
                check(cu.cuIpcGetEventHandle(ctypes.byref(h), ev), "cuIpcGetEventHandle")
                a.send(bytes(h))
                extra["cuIpcOpenEventHandle_us"] = round(_answer(a, p), 1)
            else:
                a.send(None)
            times = []
            for i in range(n // 3):
                t0 = time.perf_counter_ns()
                if cuda:
                    y.copy_(x, non_blocking=True)  # (to pinned: async)
                if event_used:
                    check(cu.cuEventRecord(ev, s), "cuEventRecord")
                if mode in _SENDER_SYNC:
                    check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
                a.send(i)
                _answer(a, p)
                times.append((time.perf_counter_ns() - t0) / 1e3)
            a.send(None)
        finally:
            p.join(30)
            if p.is_alive():
                p.kill()
            if ev is not None:
                cu.cuStreamSynchronize(s)
                cu.cuEventDestroy_v2(ev)
        kept = sorted(times[len(times) // 10:])  # less the first tenth (warm-up)
        emit(f"hop {mode}: {label}", round(statistics.median(kept), 1),
             p90=round(kept[int(0.9 * (len(kept) - 1))], 1), **extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--hops-only", action="store_true", help="only the two-process hops")
    args = ap.parse_args()
    emit("device", 0, name=torch.cuda.get_device_name(0), torch=torch.__version__,
         cores=os.cpu_count())
    if not args.hops_only:
        host_costs(args.n)
    ping_pongs(args.n)


if __name__ == "__main__":
    main()
