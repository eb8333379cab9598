# SPDX-License-Identifier: BSD-3-Clause
"""Workers for test_agent_receive.py: a worker that never used CUDA itself,
a receiving side short of device memory, maps between the CPU and a GPU,
and CUDA tensors no map names. Each runs in a spawned process on the
driver under test, as agent_worker's do (whose helpers these use)."""

import os
import time

import torch
import torch.distributed.autograd as dist_autograd
from torch.distributed import rpc

import torch_rpc_ext
from tests.cuda_driver.agent_worker import (
    DEVICE,
    TIMEOUT,
    agent_metrics,
    channel_counters,
    cuda_tensor,
    cuda_view,
    describe,
    identity,
    join_pair,
    pattern,
    real_cuda,
    setup_torch,
    tensor_bytes,
)
from tests.cuda_driver.worker import fake_stats

MIB = 1 << 20
BIG = 32 * MIB  # past a short worker's memory
SHORT = 16 * MIB


def cuda_metrics() -> dict[str, int]:
    return {k[len("rpc_ext.cuda."):]: int(v) for k, v in agent_metrics().items()
            if k.startswith("rpc_ext.cuda.")}


def numel(t) -> int:
    return t.numel()


def make(n: int, seed: int):
    return cuda_tensor(pattern(n, seed))


def plain(t):
    return t + 1


def cuda_initialized() -> bool | None:
    """torch's own answer on a GPU; None on the fake."""
    return torch.cuda.is_initialized() if real_cuda() else None


# ---- a worker that never used CUDA ---------------------------------------------


def run_untouched(rank: int, port: int, ctl) -> None:
    """worker1 does nothing with CUDA itself, not even before init_rpc
    returns on worker0: the first thing it gets is a CUDA tensor. On a GPU
    torch's caching allocator had no tables for the device (torch's lazy
    init had not run) and the landing crashed the connection; the fake's
    allocator refuses until torch's init, as torch's does."""
    if rank == 1:
        setup_torch()
        before = cuda_initialized()
    join_pair(rank, port)
    out = {}
    if rank == 0:
        time.sleep(1)  # worker1 looks at what init_rpc prepared first
        data = pattern(3 * MIB, 21)
        try:
            out["seen"] = rpc.rpc_sync("worker1", describe, args=(cuda_tensor(data),)) == (
                f"cuda:{DEVICE}", data)
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
        out["callee_initialized"] = rpc.rpc_sync("worker1", cuda_initialized)
        out["callee_failures"] = rpc.rpc_sync("worker1", cuda_metrics)["receive_failures"]
    else:
        out["initialized_before"] = before
        # Warmed at init_rpc, not on a loop thread as the first tensor lands:
        # the copy engine's modules (the fake counts them) and the context.
        stats = fake_stats()
        out["warm"] = (stats["live"]["modules"], stats["live"]["context_retains"]) \
            if stats else None
    rpc.shutdown()
    ctl.send(out)


# ---- a receiving side short of device memory -------------------------------------


def limit_memory() -> None:
    """This process may hold little device memory: the fake's limit (read
    when the driver loads), or torch's allocator capped on a GPU."""
    if real_cuda():
        total = torch.cuda.get_device_properties(DEVICE).total_memory
        torch.cuda.set_per_process_memory_fraction(SHORT / total, DEVICE)
    else:
        os.environ["FAKE_CUDA_MEM_LIMIT"] = str(SHORT)


def remote_error() -> str:
    """What to_here() raises for a remote() whose 32 MiB argument cannot land
    ("" if it returns)."""
    rref = rpc.remote("worker1", numel, args=(cuda_tensor(bytes(BIG)),))
    try:
        rref.to_here()
        return ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)


def run_short(rank: int, port: int, ctl, short: int, channels=("cuda_ipc",),
              transports=None) -> None:
    """Worker `short` cannot allocate what a message brings: with 1, worker0
    sends worker1 a 32 MiB tensor (the request cannot land); with 0, worker0
    asks worker1 for one (the response cannot). That call fails, naming the
    worker, the bytes and the cause; the next, small, on the same
    connection works. `channels`, `transports`: cuda_ipc over shm (the
    landing in torch's memory fails), or cuda_staged over TCP (as between
    hosts: the channel's own staging block fails first on the fake)."""
    if rank == short and not real_cuda():
        limit_memory()  # before the driver loads
    join_pair(rank, port, device_channels=channels, transports=transports)
    if rank == short and real_cuda():
        limit_memory()
    out = {}
    if rank == 0:
        small = pattern(4096, 3)
        try:
            if short == 1:
                rpc.rpc_sync("worker1", numel, args=(cuda_tensor(bytes(BIG)),))
            else:
                rpc.rpc_sync("worker1", make, args=(BIG, 1))
            out["error"] = ""
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
        if short == 1:
            # remote(): the OwnerRRef holds the error, and to_here() raises
            # it at once (no pending fork left to wait out its timeout).
            out["remote_error"] = remote_error()
            # The same in a dist autograd context, where torch wraps every
            # remote() (FORWARD_AUTOGRAD_REQ): until session 97 its caller
            # got a plain error, its fork stayed pending, and to_here()
            # waited out the timeout.
            with dist_autograd.context():
                out["autograd_remote_error"] = remote_error()
            out["after"] = rpc.rpc_sync("worker1", describe, args=(cuda_tensor(small),)) == (
                f"cuda:{DEVICE}", small)
        else:
            out["after"] = tensor_bytes(rpc.rpc_sync("worker1", make, args=(4096, 3))) == small
        out["failures"] = (cuda_metrics()["receive_failures"],
                           rpc.rpc_sync("worker1", cuda_metrics)["receive_failures"])
        metrics = agent_metrics()
        out["rejected"] = {k: v for k, v in metrics.items() if "rejected" in k and v != "0"}
    rpc.shutdown()
    ctl.send(out)


# ---- a worker whose driver will not map its peer's memory ------------------------


def run_unmappable(rank: int, port: int, ctl, sharing: str) -> None:
    """worker1's driver opens no memory of another process (the fake's
    switch: a legacy handle with `sharing` "legacy", a VMM descriptor with
    "fd"). worker0's first CUDA call to it fails, naming that; worker0 then
    lends it no block, and the next calls go by the next device channel.
    Replies from worker1 go by cuda_ipc as ever (worker0 maps its blocks)."""
    if sharing == "legacy":
        os.environ["TORCH_RPC_EXT_CUDA_IPC_LEGACY"] = "1"
    if rank == 1:  # before the driver loads
        os.environ["FAKE_CUDA_IPC_MEM_OPEN_FAILS" if sharing == "legacy"
                   else "FAKE_CUDA_IPC_IMPORT_FAILS"] = "1"
    join_pair(rank, port)
    out = {}
    if rank == 0:
        data = pattern(3 * MIB, 5)
        try:
            rpc.rpc_sync("worker1", describe, args=(cuda_tensor(data),))
            out["error"] = ""
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
        out["after"] = [
            rpc.rpc_sync("worker1", describe, args=(cuda_tensor(data),)) == (
                f"cuda:{DEVICE}", data)
            for _ in range(2)]
        small = pattern(4096, 6)
        out["back"] = tensor_bytes(rpc.rpc_sync("worker1", identity,
                                                args=(cuda_tensor(small),))) == small
        out["counters"] = {c: channel_counters(c)
                           for c in ("cuda_ipc", "cuda_ring", "cuda_staged")}
        out["callee"] = rpc.rpc_sync("worker1", channel_counters, args=("cuda_ipc",))
        out["failures"] = rpc.rpc_sync("worker1", cuda_metrics)["receive_failures"]
        metrics = agent_metrics()
        out["rejected"] = {k: v for k, v in metrics.items() if "rejected" in k and v != "0"}
        out["lost"] = {k: v for k, v in metrics.items() if "lost" in k and v != "0"}
    rpc.shutdown()
    ctl.send(out)


# ---- a peer whose map names a device we do not serve ------------------------------


def run_off_map(rank: int, port: int, ctl, channels, transports) -> None:
    """worker0 maps its cuda:0 to worker1's cuda:1, but worker1 serves
    cuda:0 only: worker1's init_rpc is made to skip the check that refuses
    such a map (as a broken or hostile peer would not honour it). worker1
    marks the frame's segments for that device before any channel lands a
    byte: the channels drop them, the call fails naming the device, worker1
    holds no context on cuda:1, and the connection stays."""
    if rank == 1:
        from torch_rpc_ext import _torch_private

        checked = _torch_private.validate_device_maps

        def unchecked(names, counts, maps, devices, me):
            reverse, _ = checked(names, counts, maps, devices, me)
            return reverse, [torch.device("cuda", 0)]

        _torch_private.validate_device_maps = unchecked
    join_pair(rank, port, target=1, device_channels=channels, transports=transports)
    out = {}
    if rank == 0:
        try:
            rpc.rpc_sync("worker1", describe, args=(cuda_tensor(pattern(3 * MIB, 8)),))
            out["error"] = ""
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["error"] = str(e)
        # A remote() call whose payload (256 KiB of argument) came in a slab
        # on shm: its OwnerRRef holds the error, so to_here() raises it at
        # once (before, the payload was gone by then: no OwnerRRef, and
        # to_here() waited out its timeout).
        for _ in range(2):  # (the first large payload makes the slab)
            rpc.rpc_sync("worker1", len, args=(b"w" * (256 << 10),))
        try:
            rpc.remote("worker1", describe_padded,
                       args=(cuda_tensor(pattern(3 * MIB, 9)), b"p" * (256 << 10))
                       ).to_here(timeout=10)
            out["remote"] = ""
        except Exception as e:  # noqa: BLE001 - the message is the result
            out["remote"] = str(e)
        out["slab_segments"] = channel_counters("shm_slab").get("segments", 0)
        out["after"] = rpc.rpc_sync("worker1", plain, args=(torch.ones(2),)).tolist()
        out["callee_retains"] = rpc.rpc_sync("worker1", context_retains)
        out["callee_devices"] = rpc.rpc_sync("worker1", devices_of_agent)
        out["callee_rejected"] = rpc.rpc_sync("worker1", rejected_metrics)
        out["callee_lost"] = sum(int(v) for k, v in rpc.rpc_sync(
            "worker1", agent_metrics).items() if k.endswith("connections_lost"))
    rpc.shutdown()
    ctl.send(out)


def describe_padded(t, pad: bytes):
    return describe(t)


def rejected_metrics() -> dict:
    return {k: v for k, v in agent_metrics().items() if "rejected" in k and v != "0"}


def context_retains():
    stats = fake_stats()
    return stats["live"]["context_retains_by_device"] if stats else None


# ---- maps between the CPU and a GPU ----------------------------------------------


def join_mapped(rank: int, port: int, mapping: dict) -> None:
    """worker0 maps `mapping` to worker1; worker1 has no map of its own."""
    setup_torch()
    opts = torch_rpc_ext.RpcExtBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", address="127.0.0.1",
        num_worker_threads=4, rpc_timeout=TIMEOUT)
    if rank == 0:
        opts.set_device_map("worker1", mapping)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)


def run_cpu_to_gpu(rank: int, port: int, ctl) -> None:
    """{"cpu": 0}: worker0's CPU tensors land on worker1's cuda:0 (the
    bytes travel as host bytes; worker1 copies them on); worker1's CUDA
    results come back to worker0's CPU by the reverse map {0: "cpu"}
    (worker1 sends a host copy). TensorPipe's test_device_map_cpu_to_gpu_*."""
    join_mapped(rank, port, {"cpu": DEVICE})
    out = {}
    if rank == 0:
        agent = rpc.api._get_current_rpc_agent()
        out["devices"] = [str(d) for d in agent._get_devices()]
        data = pattern(3 * MIB, 5)
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out["seen"] = rpc.rpc_sync("worker1", describe, args=(host,)) == (f"cuda:{DEVICE}", data)
        back = rpc.rpc_sync("worker1", identity, args=(host,))
        out["back"] = (str(back.device), back.numpy().tobytes() == data)
        # Small, empty and a strided view, in one message.
        view = torch.arange(4096, dtype=torch.float32).view(64, 64)[:, ::4]
        got = rpc.rpc_sync("worker1", identity, args=([host[:100], host[:0], view],))
        out["mixed"] = ([str(t.device) for t in got],
                        got[0].numpy().tobytes() == data[:100], got[1].numel(),
                        torch.equal(got[2], view))
        out["metrics"] = rpc.rpc_sync("worker1", cuda_metrics)
    rpc.shutdown()
    ctl.send(out)


def run_gpu_to_cpu(rank: int, port: int, ctl) -> None:
    """{0: "cpu"}: worker0's CUDA tensors land on worker1's CPU (a host copy
    made on worker0's stream travels); worker1's CPU results come back on
    worker0's cuda:0 by the reverse map {"cpu": 0}. worker1 has no CUDA
    device of its own. TensorPipe's test_device_map_gpu_to_cpu_*."""
    join_mapped(rank, port, {DEVICE: "cpu"})
    out = {}
    if rank == 0:
        data = pattern(3 * MIB, 6)
        t = cuda_tensor(data)
        out["seen"] = rpc.rpc_sync("worker1", describe_host, args=(t,)) == ("cpu", data)
        back = rpc.rpc_sync("worker1", identity, args=(t,))
        out["back"] = (str(back.device), tensor_bytes(back) == data)
        view, packed = cuda_view(pattern(1 << 20, 7), (256, 1024),
                                 (slice(None), slice(1, None, 4)))
        got = rpc.rpc_sync("worker1", host_layout, args=(view,))
        out["view"] = got == ("cpu", (256, 256), packed)
        # Lazy negative and conjugate views (metadata only: no kernel on the
        # fake): their host copies kept the bits off, the peer got x for -x.
        lazy = pattern(4096, 8)
        for key, dtype, view_of in (("neg", torch.float32, torch._neg_view),
                                    ("conj", torch.complex64, torch.conj)):
            sent = view_of(cuda_tensor(lazy).view(dtype))
            want = view_of(torch.frombuffer(bytearray(lazy), dtype=dtype))
            want = want.resolve_conj().resolve_neg().numpy().tobytes()
            out[key] = rpc.rpc_sync("worker1", describe_host, args=(sent,)) == ("cpu", want)
        out["metrics"] = cuda_metrics()
        out["callee_devices"] = rpc.rpc_sync("worker1", devices_of_agent)
    rpc.shutdown()
    ctl.send(out)


def describe_host(t):
    return str(t.device), t.numpy().tobytes()


def host_layout(t):
    return str(t.device), tuple(t.shape), t.contiguous().numpy().tobytes()


def devices_of_agent():
    return [str(d) for d in rpc.api._get_current_rpc_agent()._get_devices()]


# ---- CUDA tensors no map names ---------------------------------------------------


def run_unmapped(rank: int, port: int, ctl) -> None:
    """No maps anywhere: a CUDA argument fails at worker0 and a CUDA result
    at worker1, each with TensorPipe's text (upstream's
    test_device_maps_missing_config*), and RPC goes on working."""
    setup_torch()
    opts = torch_rpc_ext.RpcExtBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", address="127.0.0.1",
        num_worker_threads=4, rpc_timeout=TIMEOUT)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)
    out = {}
    if rank == 0:
        for what, call in (("request", lambda: rpc.rpc_sync(
                               "worker1", numel, args=(cuda_tensor(b"x" * 64),))),
                           ("remote_request", lambda: rpc.remote(
                               "worker1", numel, args=(cuda_tensor(b"x" * 64),)).to_here()),
                           ("response", lambda: rpc.rpc_sync("worker1", make, args=(64, 1))),
                           ("remote", lambda: rpc.remote(
                               "worker1", make, args=(64, 1)).to_here())):
            try:
                call()
                out[what] = ""
            except Exception as e:  # noqa: BLE001 - the message is the result
                out[what] = str(e)
        out["after"] = rpc.rpc_sync("worker1", plain, args=(torch.ones(2),)).tolist()
    rpc.shutdown()
    ctl.send(out)


def run_self_without_cuda_self(port: int, ctl) -> None:
    """A world of one whose device channels leave out cuda_self: its CUDA
    tensor to itself fails at the send naming what would carry it, and the
    worker goes on working."""
    setup_torch()
    opts = torch_rpc_ext.RpcExtBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", address="127.0.0.1",
        num_worker_threads=4, rpc_timeout=TIMEOUT, device_channels=("cuda_ipc",))
    opts.set_device_map("worker0", {DEVICE: DEVICE})
    rpc.init_rpc("worker0", rank=0, world_size=1,
                 backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)
    out = {}
    try:
        rpc.rpc_sync("worker0", identity, args=(cuda_tensor(b"x" * 64),))
        out["error"] = ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["error"] = str(e)
    # The refused call is not left in flight (until session 58 it stayed
    # there until its timeout, and rpc.shutdown() waited 60 s for it).
    out["pending"] = int(
        rpc.api._get_current_rpc_agent().get_debug_info()["rpc_ext.pending_calls"])
    # A CUDA result to itself: refused at the response's send, and the
    # caller gets that error as the call's (until session 58 the error
    # went to the log and the call waited out its timeout).
    try:
        rpc.rpc_sync("worker0", make, args=(64, 1))
        out["response_error"] = ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["response_error"] = str(e)
    out["after"] = rpc.rpc_sync("worker0", plain, args=(torch.ones(2),)).tolist()
    rpc.shutdown()
    ctl.send(out)
