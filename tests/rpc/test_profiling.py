# SPDX-License-Identifier: BSD-3-Clause
"""Each request is served from a clean thread-local state. Remote profiling
keeps working for every call, not just the first one a
server thread handles (upstream's legacy profiler leaves per-thread state
behind; TensorPipe loses the callee's events once its pool threads are used)."""

import pytest
import torch
from torch.autograd.profiler_legacy import profile
from torch.distributed import rpc

from tests.rpc.world import init, run_world

pytestmark = pytest.mark.timeout(120)


def profiled_calls(rank, world_size, n):
    init(rank, world_size, num_worker_threads=2)
    missing = []
    if rank == 0:
        for i in range(n):
            with profile() as prof:
                rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), torch.ones(1)))
            if not [e for e in prof.function_events if e.node_id == 1]:
                missing.append(i)
    rpc.shutdown()
    return missing


def test_every_profiled_call_brings_back_remote_events():
    # With 2 server threads, calls 2.. would lose their remote events if a
    # thread's profiler state leaked from one request to the next.
    assert run_world(profiled_calls, n=12)[0] == []


def leaves_grad_off() -> bool:
    torch.set_grad_enabled(False)  # and never back on
    return torch.is_grad_enabled()


def grad_enabled() -> bool:
    return torch.is_grad_enabled()


def grad_mode_calls(rank, world_size, n):
    init(rank, world_size, num_worker_threads=2)
    seen = []
    if rank == 0:
        for _ in range(n):
            seen.append((rpc.rpc_sync("worker1", leaves_grad_off),
                         rpc.rpc_sync("worker1", grad_enabled)))
    rpc.shutdown()
    return seen


def test_a_function_that_leaves_grad_mode_off_does_not_leak_into_the_next_call():
    # Every request starts from the thread-local state its serving thread
    # had before it served any (csrc/agent/server.cpp): grad mode included.
    assert run_world(grad_mode_calls, n=4)[0] == [(False, True)] * 4



def leaves_grad_off_with(rref) -> bool:
    return leaves_grad_off()


def pending_rref_grad_mode_calls(rank, world_size, n):
    init(rank, world_size, num_worker_threads=2)
    seen = []
    if rank == 0:
        for _ in range(n):
            # An RRef of worker2's, passed on by worker0: worker1 runs the
            # function once worker2 confirmed the fork, in that reply's
            # completion, on worker1's loop thread and outside any serve.
            rref = rpc.remote("worker2", torch.add, args=(torch.ones(1), 1))
            seen.append((rpc.rpc_sync("worker1", leaves_grad_off_with, args=(rref,)),
                         rpc.rpc_sync("worker1", grad_enabled)))
    rpc.shutdown()
    return seen


def test_a_function_run_once_its_rrefs_are_confirmed_does_not_leak_into_the_next_call():
    # That run is not inside a serve: the next serve starts from the
    # pristine state all the same.
    assert run_world(pending_rref_grad_mode_calls, world_size=3, n=4)[0] == [(False, True)] * 4


def leaves_grad_off_with_two(a, b) -> bool:
    return leaves_grad_off()


def grad_enabled_with_two(a, b) -> bool:
    return torch.is_grad_enabled()


def completion_thread_grad_mode_calls(rank, world_size, n):
    init(rank, world_size, num_worker_threads=2)
    seen = []
    if rank == 0:
        def two():
            return [rpc.remote("worker2", torch.add, args=(torch.ones(1), i)) for i in range(2)]

        retired = "rpc_ext.completions.retired_futures"
        before = int(rpc.rpc_sync("worker1", debug_info)[retired])
        for _ in range(n):
            # Two RRefs of worker2's: worker1 asks worker2 to confirm both,
            # two calls in flight, so the second reply (after which the
            # function runs) is completed on worker1's completion thread,
            # which never serves. So is the next call's.
            seen.append((rpc.rpc_sync("worker1", leaves_grad_off_with_two, args=tuple(two())),
                         rpc.rpc_sync("worker1", grad_enabled_with_two, args=tuple(two()))))
        # (Every completion there retires its future.)
        seen.append(int(rpc.rpc_sync("worker1", debug_info)[retired]) > before)
    rpc.shutdown()
    return seen


def debug_info():
    return rpc.api._get_current_rpc_agent().get_debug_info()


def test_a_function_run_on_the_completion_thread_does_not_leak_into_the_next_one():
    # Every completion there ends with the thread's first thread-local
    # state back if the cheap signs of a change show (csrc/agent/thread_state.h).
    assert run_world(completion_thread_grad_mode_calls, world_size=3, n=4)[0] == [
        (False, True)] * 4 + [True]
