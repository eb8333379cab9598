"""What a stream waiting on a dead process's CUDA IPC event does, on a GPU.

docs/reliability.md ("Peer death on the CUDA channels") names a hazard
found by reading and never provoked: cuda_ipc waits on the device for
events its peer records (a landing's `ready`, a reused block's `released`),
and no device-side wait can be cancelled; if a peer is killed with such a
record pending, does the waiting stream (the caller's, or a connection's
copy stream) wait for ever, or does the driver complete the peer's events
when it tears the dead process's context down? The answer decides the
remedy (a host-side check before a wait that a dead peer could hold, or
none), and only hardware gives it: the fake driver does what we tell it.

Three processes on one GPU, as two workers and the check:
  exporter  makes an interprocess event, records it behind a kernel that
            sleeps for `--sleep` s on its own stream, hands the event over,
            and waits to be killed;
  waiter    opens the event, makes a stream of its own wait on it
            (cuStreamWaitEvent, as cuda_ipc's landing does), queues an add
            and an event behind that, and reports;
  parent    kills the exporter (SIGKILL) while its kernel still runs, then
            has the waiter watch its stream for `--watch` s, and then a
            fresh stream of the same context, for the context's health.

One JSON line: {"check": "ipc_event_peer_death", "waiter": "completed" |
"stuck", "after_s": seconds from the kill to the waiter's stream completing
(or the watch's length), "other_stream": "ok" | "stuck", "value": what the
add left where it ran (1), "exporter_exit": its exit code (-9),
"exporter_gone_s": seconds until the killed process was reaped}. "stuck"
means the hazard is real. Exit status 0 once the line is written (either
answer is a finding, not a failure); 1 if the check itself failed. About
25 s on an H200 (two processes' CUDA start-up, then the watch). Run by
tools/gpu_check.sh's optional `peer_death` step.
"""

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback

import torch

# Run as a script from tools/ (spawned children too: sys.path travels).
from gpu_probe import Handle, check, libcuda

CU_EVENT_DISABLE_TIMING, CU_EVENT_INTERPROCESS = 0x2, 0x4
CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13  # kHz


def exporter(conn, sleep_s):
    try:
        torch.empty(1, device="cuda")
        lib = libcuda()
        khz = ctypes.c_int()
        check(lib.cuDeviceGetAttribute(ctypes.byref(khz), CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 0),
              "cuDeviceGetAttribute")
        event = ctypes.c_void_p()
        check(lib.cuEventCreate(ctypes.byref(event),
                                CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS),
              "cuEventCreate")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(sleep_s * khz.value * 1000))
        check(lib.cuEventRecord(event, ctypes.c_void_p(stream.cuda_stream)), "cuEventRecord")
        handle = Handle()
        check(lib.cuIpcGetEventHandle(ctypes.byref(handle), event), "cuIpcGetEventHandle")
        conn.send(("event", ctypes.string_at(ctypes.byref(handle), 64)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    time.sleep(600)  # killed by the parent


def poll(event, seconds):
    """Seconds until `event` completed, or None if it did not within `seconds`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if event.query():
            return time.monotonic() - t0
        time.sleep(0.005)
    return None


def waiter(conn, watch_s):
    try:
        torch.empty(1, device="cuda")
        lib = libcuda()
        kind, raw = conn.recv()
        event = ctypes.c_void_p()
        check(lib.cuIpcOpenEventHandle(ctypes.byref(event), Handle.from_buffer_copy(raw)),
              "cuIpcOpenEventHandle")
        x = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        check(lib.cuStreamWaitEvent(ctypes.c_void_p(stream.cuda_stream), event, 0),
              "cuStreamWaitEvent")
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            x.add_(1)
            done.record(stream)
        conn.send(("waiting", bool(done.query())))
        conn.recv()  # the exporter is dead
        after = poll(done, watch_s)
        other = torch.cuda.Stream()
        fresh = torch.cuda.Event()
        with torch.cuda.stream(other):
            torch.ones(1, device="cuda").mul_(2)
            fresh.record(other)
        other_ok = poll(fresh, 5.0) is not None
        value = int(x.item()) if after is not None else None
        conn.send(("result", after, other_ok, value))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    # Not the interpreter's teardown: it may wait on the stuck stream.
    os._exit(0)


def answer(conn, seconds, who):
    if not conn.poll(seconds):
        raise RuntimeError(f"the {who} gave no answer in {seconds} s")
    got = conn.recv()
    if got[0] == "error":
        raise RuntimeError(f"the {who} failed:\n{got[1]}")
    return got


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=60.0,
                        help="the exporter's kernel (killed long before it ends)")
    parser.add_argument("--watch", type=float, default=12.0)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ours_e, theirs_e = ctx.Pipe()
    ours_w, theirs_w = ctx.Pipe()
    exp = ctx.Process(target=exporter, args=(theirs_e, args.sleep))
    wait = ctx.Process(target=waiter, args=(theirs_w, args.watch))
    exp.start()
    wait.start()
    row = {"check": "ipc_event_peer_death"}
    try:
        _, raw = answer(ours_e, 90, "exporter")
        ours_w.send(("event", raw))
        _, done_before = answer(ours_w, 90, "waiter")
        if done_before:
            raise RuntimeError("the waiter's stream completed before the kill: "
                               "the exporter's kernel was not pending")
        t0 = time.monotonic()
        os.kill(exp.pid, signal.SIGKILL)
        exp.join(30)
        row["exporter_gone_s"] = round(time.monotonic() - t0, 3)
        row["exporter_exit"] = exp.exitcode
        ours_w.send(("dead",))
        _, after, other_ok, value = answer(ours_w, args.watch + 30, "waiter")
        row.update(waiter="completed" if after is not None else "stuck",
                   after_s=round(after if after is not None else args.watch, 3),
                   other_stream="ok" if other_ok else "stuck", value=value)
        ok = True
    except Exception as e:
        row.update(ok=False, error=str(e)[-2000:])
        ok = False
    finally:
        for p in (exp, wait):
            if p.is_alive():
                p.kill()
            p.join(10)
    print(json.dumps(row), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
