# SPDX-License-Identifier: BSD-3-Clause
"""The closers of descriptors a peer handed us (csrc/common/fd_closer.h):
once every closer is stuck on a close that waits (a TCP socket set to
linger, with bytes nobody reads), what comes next goes to a child process
whose exit makes the last close, which does not linger; nothing waits
open, and the child is gone at once."""

import time

import pytest

from torch_rpc_ext import _testing
from torch_rpc_ext.testing import lingering_socket

pytestmark = pytest.mark.timeout(120)

MAX_CLOSERS = 16  # kMaxClosers
LINGER_S = 60


def wait_for(predicate, seconds=15):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stats = _testing.peer_fd_stats()
        if predicate(stats):
            return stats
        time.sleep(0.05)
    return stats


def test_with_every_closer_stuck_a_lingering_socket_goes_to_an_exiting_child():
    if not _testing.peer_fd_stats()["hand_over"]:
        pytest.skip("a sanitizer build: no hand-over to a child (fd_closer.cpp)")
    start = wait_for(lambda s: s["pending"] == 0)  # (an earlier test's closes)
    assert start["pending"] == 0, start
    pairs = [lingering_socket(LINGER_S) for _ in range(MAX_CLOSERS + 2)]
    try:
        # Every closer stuck, one socket each.
        for client, _ in pairs[:MAX_CLOSERS]:
            _testing.close_peer_fds([client.detach()])
        stuck = wait_for(lambda s: s["pending"] == MAX_CLOSERS, 5)
        assert stuck["pending"] == MAX_CLOSERS and stuck["via_children"] == start["via_children"], stuck
        # The next two: closed through a child (in one or two hand-overs).
        for client, _ in pairs[MAX_CLOSERS:]:
            _testing.close_peer_fds([client.detach()])
        after = wait_for(lambda s: s["pending"] == MAX_CLOSERS and s["children"] == 0)
        assert after["via_children"] - start["via_children"] == 2, after
        assert after["pending"] == MAX_CLOSERS, after  # ours returned at once
        assert after["children"] == 0, after  # its exit did not linger
        assert after["closed"] - start["closed"] == 2, after
        # Their last closes were made (no copy of ours left open; that they
        # did not linger, pending and children above say): the other ends
        # read what was queued, then the end.
        for _, other in pairs[MAX_CLOSERS:]:
            other.settimeout(10)
            while other.recv(1 << 16):
                pass
    finally:
        for _, other in pairs:
            other.close()  # resets the stuck ones: their closes return
    done = wait_for(lambda s: s["pending"] == 0)
    assert done["pending"] == 0, done
