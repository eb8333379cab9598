# SPDX-License-Identifier: BSD-3-Clause
"""The agent's worker pool cannot be starved into deadlock by blocking tasks."""

import pytest

from torch_rpc_ext import _testing


@pytest.mark.parametrize("core, n", [(1, 2), (1, 16), (4, 64), (2, 3)])
def test_chain_of_blocking_tasks_completes(core, n):
    # Task i waits for task i+1 to start, like a UDF waiting on a nested RPC
    # whose completion is queued behind it. A fixed pool of `core` threads
    # deadlocks whenever n > core.
    finished, size = _testing.pool_chain(core, n, 20.0)
    assert finished
    assert size >= min(n, core)


def test_back_to_back_posts_to_one_idle_thread_do_not_strand_work():
    # Two tasks posted while a single thread is idle: if the pool counted idle
    # threads to decide whether to grow, the second task could be stranded
    # behind the first (which waits for it). Repeat to hit the race window.
    for _ in range(200):
        finished, _ = _testing.pool_chain(1, 2, 5.0)
        assert finished


def test_pool_does_not_grow_without_need():
    # Tasks that do not block finish on the core threads. The supervisor's
    # stall timeout is long here: at the default 20 ms a loaded machine can
    # leave all four idle threads unscheduled that long, and then growing
    # is the pool doing its job.
    finished, size = _testing.pool_chain(4, 1, 5.0, stall_ms=2000)
    assert finished and size == 4


def test_a_stop_returns_once_the_workers_are_joined_and_strands_no_task():
    # The worker, having decided to exit, waits in its exit hook for the GIL
    # this call holds. A second stop() returned at once (the first had taken
    # the threads to join), and a task posted then was queued for a worker
    # that would never look again: kept until the pool was destroyed.
    seen = _testing.pool_stops_while_its_worker_exits(0.3)
    assert seen["worker_was_exiting"], seen
    assert seen["size_at_first_return"] == 0, seen
    assert seen["size_at_second_return"] == 0, seen
    assert seen["queued_after_stop"] == 0, seen
    assert not seen["late_task_ran"] and seen["late_task_released"], seen


SHORT_OF_MEMORY = """
import resource
from torch_rpc_ext import _testing
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
# Room for little more than what is mapped now: a thread's stack and arena
# cannot be had.
resource.setrlimit(resource.RLIMIT_AS, (vm + 150 * 2**20, resource.RLIM_INFINITY))
finished, size = _testing.pool_chain(1, 64, 3.0)
print("size", size, flush=True)
"""


def test_a_thread_the_pool_cannot_get_ends_nothing():
    # Every task blocks, so the pool adds threads until the system refuses
    # one: the refusal was thrown out of the supervisor's thread, and the
    # process aborted (std::terminate). Now the tasks wait, and it is said.
    import resource
    import subprocess
    import sys

    def eight_mib_stacks():  # (threads' stacks default to RLIMIT_STACK's size)
        resource.setrlimit(resource.RLIMIT_STACK,
                           (8 << 20, resource.getrlimit(resource.RLIMIT_STACK)[1]))

    out = subprocess.run([sys.executable, "-c", SHORT_OF_MEMORY], capture_output=True,
                         text=True, timeout=120, preexec_fn=eight_mib_stacks)
    # (Whether the refusal is also said depends on what memory the log had
    # left: under ThreadSanitizer's allocator, none. The process going on is
    # what a refusal used to take away: SIGABRT.)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("size "), out.stdout
