# SPDX-License-Identifier: BSD-3-Clause
"""A worker of test_agent_cuda.py's lanes test: CUDA tensors between hosts
(TCP, no shared memory) go through cuda_staged's copies out of the device
and then over tcp_lanes, striped as the copies complete."""

import random
import time

from torch.distributed import rpc

from tests.cuda_driver.agent_worker import (
    big_cuda_tensor,
    channel_counters,
    identity,
    join_pair,
    large_round_trips,
    tensor_bytes,
)

# Past cuda_staged's 4 MiB chunk many times over; odd (stripes end off
# their 64 KiB alignment); the lanes' minimum.
SIZES = (40 << 20, (3 << 20) + 7, 1 << 20)
CONCURRENT = 4  # calls of CONCURRENT_BYTES at once, both ways
CONCURRENT_BYTES = 6 << 20
VIEW_SPAN = 4 << 20  # a float32 1024 x 1024, every other column sent


def lanes_opened() -> int:
    return channel_counters("tcp_lanes").get("lanes_opened", 0)


def dial_lanes(rng, timeout: float = 30) -> bool:
    """1 MiB calls (each large segment dials its sender's lanes if the
    peer's offer is in; it rides the stream meanwhile) until both
    processes have their 4 lanes out and 4 in, and the bytes came back."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = rng.randbytes(1 << 20)
        back = rpc.rpc_sync("worker1", identity, args=(big_cuda_tensor(data),))
        if tensor_bytes(back) != data:
            return False
        if lanes_opened() >= 8 and rpc.rpc_sync("worker1", lanes_opened) >= 8:
            return True
        time.sleep(0.05)
    return False


def counters():
    """Both processes' tcp_lanes and cuda_staged counters."""
    return {c: (channel_counters(c), rpc.rpc_sync("worker1", channel_counters, args=(c,)))
            for c in ("tcp_lanes", "cuda_staged")}


def run(rank: int, port: int, ctl, encryption: str) -> None:
    """worker0 sends CUDA tensors of 1 to 40 MiB to worker1 and gets them
    back, a strided view, then CONCURRENT calls at once, once both sides'
    lanes are up (dial_lanes). Reports whether every byte came back and
    both sides' tcp_lanes and cuda_staged counters before and after."""
    join_pair(rank, port, device_channels=("cuda_staged",), transports=("tcp",),
              channels=("tcp_lanes",), encryption=encryption)
    out = {}
    if rank == 0:
        try:
            rng = random.Random(11)
            out["lanes_up"] = dial_lanes(rng)
            out["before"] = counters()
            out.update(large_round_trips(rng, SIZES, VIEW_SPAN, CONCURRENT, CONCURRENT_BYTES))
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
        out["after"] = counters()
    rpc.shutdown()
    ctl.send(out)


def fail_copy_out_after(n: int) -> None:
    """The fake driver: the (n+1)-th asynchronous copy out of a device from
    now on faults (tests/cuda_fake: fake_cuda_fail_dtoh_after)."""
    import ctypes
    import os

    lib = ctypes.CDLL(os.environ["TORCH_RPC_EXT_LIBCUDA"])  # the one loaded
    lib.fake_cuda_fail_dtoh_after(ctypes.c_long(n))


def run_failed_copy(rank: int, port: int, ctl) -> None:
    """With the lanes up, worker0's copy out of its device faults at the
    third 4 MiB chunk of a 40 MiB tensor whose first stripes the lanes are
    writing: reports the call's error, how long it took, and whether calls
    after it work (CPU and CUDA, over a new connection)."""
    join_pair(rank, port, device_channels=("cuda_staged",), transports=("tcp",),
              channels=("tcp_lanes",), encryption="off")
    out = {}
    if rank == 0:
        rng = random.Random(5)
        out["lanes_up"] = dial_lanes(rng)
        fail_copy_out_after(2)
        t0 = time.monotonic()
        try:
            rpc.rpc_sync("worker1", identity, args=(big_cuda_tensor(rng.randbytes(40 << 20)),))
            out["error"] = ""
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
        out["seconds"] = time.monotonic() - t0
        data = rng.randbytes(3 << 20)
        back = rpc.rpc_sync("worker1", identity, args=(big_cuda_tensor(data),))
        out["after"] = tensor_bytes(back) == data
    rpc.shutdown()
    ctl.send(out)


def run_slow_copy(rank: int, port: int, ctl, encryption: str, delay_ms: int,
                  heartbeat: float) -> None:
    """With the lanes up, worker0's copies out of its device each run
    `delay_ms` late (the fake's kernel delay): the lanes wait for a 5 MiB
    tensor's two chunks while worker1 holds its record. Reports whether
    the call came back intact (or its error), and both sides' tcp_lanes
    counters."""
    from tests.cuda_driver.worker import set_fake_kernel_delay

    join_pair(rank, port, device_channels=("cuda_staged",), transports=("tcp",),
              channels=("tcp_lanes",), encryption=encryption, heartbeat_timeout=heartbeat)
    out = {}
    if rank == 0:
        rng = random.Random(7)
        out["lanes_up"] = dial_lanes(rng)
        data = rng.randbytes((5 << 20) + 3)
        t = big_cuda_tensor(data)
        set_fake_kernel_delay(delay_ms)
        try:
            back = rpc.rpc_sync("worker1", identity, args=(t,))
            set_fake_kernel_delay(0)
            out["back"] = tensor_bytes(back) == data
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
        set_fake_kernel_delay(0)
        out["lanes"] = (channel_counters("tcp_lanes"),
                        rpc.rpc_sync("worker1", channel_counters, args=("tcp_lanes",)))
    rpc.shutdown()
    ctl.send(out)
