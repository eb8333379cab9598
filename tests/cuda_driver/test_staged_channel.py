# SPDX-License-Identifier: BSD-3-Clause
"""The cuda_staged channel through the channel seam: two processes, one TCP
connection with no agent above it (_testing.Endpoint), device memory of the
driver under test. The fake runs every asynchronous copy 50 ms late
(slow_kernels), so a stream that wrote a chunk before its copy out of the
device had completed, or a reader not ordered after the copies onto the
device, would see old bytes. What passes against the fake proves the
protocol and the ordering, not the hardware (docs/cuda.md)."""

import pytest

from tests.cuda_driver import staged_worker
from tests.cuda_driver.test_ipc_channel import play

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("slow_kernels")]


def run(spawn, scenario):
    return play(spawn, scenario, worker=staged_worker)


def test_segments_travel_out_and_back_through_host_memory(spawn):
    (back, pinned, sender), (seen, receiver) = run(spawn, "roundtrip")
    sizes = staged_worker.SIZES * staged_worker.ROUNDS
    assert seen == [(b"m%d" % (i % 4), n, 0, True) for i, n in enumerate(sizes)]
    assert back == [(b"back%d" % (i % 4), n, True) for i, n in enumerate(sizes)]
    for counters in (sender, receiver):
        assert counters["segments_sent"] == counters["segments_received"] == len(sizes)
        assert counters["bytes_sent"] == sum(sizes)
        assert counters["declined"] == 0
    # Chunked: 3 + 1 + 1 + 1 copies per round and direction, out and in.
    assert sender["chunk_copies"] == staged_worker.ROUNDS * 2 * 6
    # Pinned buffers come from the pool: one a size class is what the rounds
    # hold (21,037,056 bytes here), plus at most one more of the largest
    # where the staging thread, held off its CPU, still held the sent
    # chunk's buffer when the reply landed. A pool that does not reuse
    # holds 42,205,184 after round one. Not "round two holds what round
    # three does": the staging thread frees a buffer idle for kStagedIdleMs
    # (5 s), which a round on a loaded host can take, and the next round
    # makes it again (CI: 4.3 MB after round two, 21 MB after round three).
    one_each = sum({staging_capacity(n) for n in staged_worker.SIZES})
    bound = one_each + staging_capacity(max(staged_worker.SIZES))
    assert 0 < min(pinned) and max(pinned) <= bound, (pinned, bound)


def staging_capacity(n: int) -> int:
    """stagingCapacity (staging_pool.cpp) up to 64 MiB: 64 KiB and up, in
    powers of two."""
    c = 64 << 10
    while c < n:
        c <<= 1
    return c


def test_a_segment_sent_while_the_connection_is_made_goes_once_it_is(spawn):
    """Sent right after connect() while our loop is stalled (a loaded host;
    staged_worker's early scenario): its copy out of the device ends, and
    the write it resumes runs in the loop's next batch with the connection's
    start. That flush took the wait for the connect's completion (EPOLLOUT)
    away, and the connection sat "waiting for the connection to be
    accepted (our socket is writable, its event not handled ...)" until its
    handshake timed out: CI's staged soak lost a connection so, twice, and
    so did this test before the fix (connection_writer.cpp)."""
    _, (head, ok) = run(spawn, "early")
    assert (head, ok) == (b"early", True)


def test_host_and_device_segments_share_a_frame(spawn):
    _, (head, ok) = run(spawn, "mixed")
    assert (head, ok) == (b"mix", (True, True))


def test_a_staged_segment_for_host_memory_closes_the_connection_naming_it(spawn):
    (got_s, reason_s), (got_r, reason_r) = run(spawn, "hostlanding")
    assert got_r is None and got_s is None
    assert "cuda_staged" in reason_r and "host memory" in reason_r
    assert reason_s  # the sender saw the connection go
