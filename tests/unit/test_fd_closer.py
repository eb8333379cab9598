# SPDX-License-Identifier: BSD-3-Clause
"""The closers of descriptors a peer handed us (csrc/common/fd_closer.h):
once every closer is stuck on a close that waits (a TCP socket set to
linger, with bytes nobody reads), what comes next goes to a child process
whose exit makes the last close, which does not linger; nothing waits
open, and the child is gone at once."""

import socket
import struct
import time

import pytest

from torch_rpc_ext import _testing

pytestmark = pytest.mark.timeout(120)

MAX_CLOSERS = 16  # kMaxClosers
LINGER_S = 60


def lingering_socket():
    """A TCP socket whose close() blocks for LINGER_S, and its other end
    (closing that one, unread bytes and all, resets it: the close returns)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client = socket.create_connection(server.getsockname())
    other, _ = server.accept()
    server.close()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, LINGER_S))
    client.setblocking(False)
    try:
        while True:
            client.send(b"x" * 65536)
    except BlockingIOError:
        pass
    return client, other


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
    pairs = [lingering_socket() for _ in range(MAX_CLOSERS + 2)]
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
