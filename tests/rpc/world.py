# SPDX-License-Identifier: BSD-3-Clause
"""Run a function on N forked worker processes and collect what each returns."""

import faulthandler
import gc
import os
import pickle
import queue as queue_module
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

import torch_rpc_ext

free_port = torch_rpc_ext.free_port  # below the ephemeral range (torch_rpc_ext/_ports.py)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    kill() only queues the stop: a thread running on another CPU stops when
    it next enters the kernel, and on a loaded VM one of ours spinning on a
    shm ring was seen answering a call sent after kill() returned. Each
    thread's state in /proc says "T" once it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    # (The state follows the name's closing parenthesis.)
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # (a thread that ended)
            if state not in ("T", "t", "Z", "X"):
                running.append(tid)
        if not running:
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGCONT)
            raise AssertionError(f"threads {running} of {pid} did not stop in {timeout}s")
        time.sleep(0.001)


def options(**options: Any) -> torch_rpc_ext.RpcExtBackendOptions:
    """The tests' options: short timeouts, few threads, loopback."""
    options.setdefault("rpc_timeout", 30)
    options.setdefault("num_worker_threads", 4)
    options.setdefault("address", "127.0.0.1")
    return torch_rpc_ext.RpcExtBackendOptions(**options)


def init(rank: int, world_size: int, **kwargs: Any) -> None:
    """init_rpc on TORCH_RPC_EXT as worker{rank}, env:// rendezvous."""
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=options(**kwargs),
    )


def _entry(fn, rank, world_size, port, queue, kwargs):
    # Forked from pytest: if a test before ran a parallel torch op in the
    # parent (tests/unit does, in one pytest run with tests/rpc), the
    # parent's OpenMP team is copied without its threads and the first
    # parallel op here waits for them forever. One intra-op thread keeps
    # torch off OpenMP (two workers on two cores need no more).
    torch.set_num_threads(1)
    # Every thread's Python stack on SIGUSR1 (run_world sends it to a rank
    # that did not finish in time, before killing it): the test's captured
    # stderr then says where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        # Plain pickle: the multiprocessing queue would share tensors through
        # shared memory that vanishes when this process exits.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, **kwargs))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()


def run_world(
    fn: Callable[..., Any],
    world_size: int = 2,
    timeout: float = 60,
    dies: frozenset[int] = frozenset(),
    **kwargs: Any,
) -> dict[int, Any]:
    """Fork ``world_size`` processes running ``fn(rank, world_size, **kwargs)``.

    Ranks in ``dies`` are expected to be killed and report nothing. Raises
    AssertionError with every failing rank's traceback, or naming the ranks
    that did not finish within ``timeout`` seconds (they are killed).
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, kwargs))
        for r in range(world_size)
    ]
    # A thread of this process holding a lock (logging's, a buffer's) as it
    # forks leaves that lock held in the child for ever: named if one hangs.
    threads = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    # Garbage this process still holds (an earlier test's frames, say, with
    # a transport endpoint among them) is collected here, where its threads
    # run: a child collecting it would run its finalizers without them and
    # could wait for ever (seen in session 98: six worlds hung in
    # "Garbage-collecting" after an in-process endpoint test failed).
    gc.collect()
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size - len(dies)):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
    except queue_module.Empty:
        missing = sorted(set(range(world_size)) - set(results) - set(dies))
        errors.append(f"ranks {missing} did not finish within {timeout}s (their stacks: "
                      f"captured stderr; threads of the forking process: {threads or 'none'})")
        for rank in missing:
            if procs[rank].is_alive():
                os.kill(procs[rank].pid, signal.SIGUSR1)
        time.sleep(1)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return results
