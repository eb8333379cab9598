# SPDX-License-Identifier: BSD-3-Clause
"""Descriptors a peer hands us cannot hold a loop thread: the last close of
a file the peer chose can wait on that file (a TCP socket set to linger with
bytes nobody acknowledges), so every peer descriptor is closed on a closer
thread (csrc/common/fd_closer.h), and a descriptor riding on a ring's
wake-up byte is taken and refused rather than dropped (and closed) by the
kernel inside our read (docs/reliability.md)."""

import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed import rpc

from tests.rpc.test_hostile_peers import SECRET
from tests.rpc.test_shm_transport import echo, loop_cpu_seconds, shut_down_wakeups_from
from tests.rpc.world import init, run_world, stop_process
from torch_rpc_ext.testing import (
    SLAB,
    closed_by_peer,
    frame_header,
    handshake,
    lingering_socket,
)

pytestmark = pytest.mark.timeout(180)

SLAB_BYTES = 2 << 20
LINGER_S = 60  # what a close of the lingering socket waits, at most


def debug_info():
    return rpc.api._get_current_rpc_agent().get_debug_info()


def refused_slab(addr, pid):
    """A slab setup whose "slab" is the socket: refused, and closed by the
    worker. Its first byte carries the descriptor; our copy is closed before
    the rest goes, so the worker holds the last one."""
    lingering, other = lingering_socket(LINGER_S)
    sock, ok = handshake(addr, SECRET)
    assert ok
    _, kept, _, _ = socket.recv_fds(sock, 32, 4)  # the agent's frame ring
    frame = frame_header(SLAB, 12) + struct.pack("<IQ", 1, SLAB_BYTES)
    socket.send_fds(sock, [frame[:1]], [lingering.fileno()])
    lingering.close()
    sock.sendall(frame[1:])
    refused = closed_by_peer(sock)
    sock.close()
    for fd in kept:
        os.close(fd)
    return refused, other


# Run as another user in a fresh interpreter (a fork of a worker, with its
# threads and torch's at-fork hooks, can hang in the child): connect to the
# worker's listener, send a byte carrying descriptor argv[2], close that
# descriptor and say so. The worker is stopped meanwhile (see below).
OTHER_USER = """
import os, socket, sys
os.setgid(65534)
os.setuid(65534)
fd = int(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\\0" + sys.argv[1][1:])
socket.send_fds(s, [b"\\0"], [fd])
os.close(fd)
sys.stdout.write("sent")
sys.stdout.flush()
"""


def from_another_user(addr, pid):
    """A process of another user, which the listener refuses unanswered (as
    SO_PEERCRED says), sends the socket before the worker accepts it: the
    worker's close of that connection lets the socket go.

    Worker ``pid`` is stopped (SIGSTOP) until the process has sent and
    closed its copy: left running, its loop could accept and refuse the
    connection before the send (on a loaded machine the woken loop thread
    preempts the process between its connect and its send, every time; CI
    once lost that race 20 times running), or the process's close could
    come after the worker's."""
    lingering, other = lingering_socket(LINGER_S)
    stop_process(pid)
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", OTHER_USER, addr, str(lingering.fileno())],
            pass_fds=[lingering.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lingering.close()  # the child's copy goes on
        try:
            # Well inside worker1's heartbeat timeout (10 s).
            out, err = child.communicate(timeout=6)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
    finally:
        os.kill(pid, signal.SIGCONT)
    if out != b"sent":
        raise AssertionError(f"the other user's process failed: {err.decode(errors='replace')}")
    return True, other


HANDOVERS = {"refused_slab": refused_slab, "from_another_user": from_another_user}


def lingering_handover(rank, world_size, how):
    init(rank, world_size, secret=SECRET)
    out = {}
    if rank == 0:
        before = debug_info_of("worker1")
        pid = rpc.rpc_sync("worker1", os.getpid)
        out["refused"], other = HANDOVERS[how](before["rpc_ext.listen.shm"], pid)
        # worker1's shm loop serves us while the close waits on the socket.
        x = torch.randn(300_000)
        start = time.monotonic()
        out["served"] = torch.equal(rpc.rpc_sync("worker1", echo, args=(x,), timeout=20), x)
        out["served_in"] = time.monotonic() - start
        during = debug_info_of("worker1")
        out["pending_during"] = int(during["rpc_ext.peer_fds.pending"])
        # The other end goes: the lingering close returns (a reset).
        other.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            after = debug_info_of("worker1")
            if int(after["rpc_ext.peer_fds.pending"]) == 0:
                break
            time.sleep(0.1)
        out["pending_after"] = int(after["rpc_ext.peer_fds.pending"])
        out["closed"] = int(after["rpc_ext.peer_fds.closed"]) - int(before["rpc_ext.peer_fds.closed"])
    rpc.shutdown()
    return out


def debug_info_of(worker):
    return rpc.rpc_sync(worker, debug_info)


@pytest.mark.parametrize("how", list(HANDOVERS))
def test_a_peer_descriptor_whose_close_blocks_does_not_block_our_loop(how):
    """refused_slab: the worker closes the descriptor itself;
    from_another_user: it goes with a socket the listener refuses
    unanswered (a connection's socket closed with messages still queued
    goes the same way)."""
    if how == "from_another_user" and os.geteuid() != 0:
        pytest.skip("needs root, to run a process as another user")
    out = run_world(lingering_handover, how=how)[0]
    assert out["refused"], out
    # Closed on worker1's loop, the socket held it for LINGER_S: the call
    # timed out (20 s) instead.
    assert out["served"] and out["served_in"] < LINGER_S / 4, out
    assert out["pending_during"] >= 1, out  # the closer waits on it
    assert out["pending_after"] == 0, out
    assert out["closed"] >= 1, out


def passes_descriptor_on_wakeups_from(pid, delay):
    """In this worker: after `delay` s, send a byte with a descriptor over
    every ring wake-up end that worker `pid` handed us (see
    shut_down_wakeups_from)."""
    import threading

    fds = shut_down_wakeups_from(pid, delay, act=False)

    def send():
        r, w = os.pipe()
        for fd in fds:
            try:
                socket.send_fds(socket.socket(fileno=os.dup(fd)), [b"\1"], [w])
            except OSError:
                pass
        os.close(r)
        os.close(w)

    threading.Timer(delay, send).start()
    return len(fds)


def misused_wakeup(rank, world_size, how):
    # Frame rings off: the ring's wake-up pairs are then the only unnamed
    # Unix sockets worker1 got from us.
    init(rank, world_size, channels=("shm_ring",), shm_frame_ring_bytes=0)
    out = {}
    if rank == 0:
        # 800 KB, a few times: the first goes as a one-off, then a ring is
        # made and handed to worker1.
        x = torch.arange(200_000, dtype=torch.float32)
        for k in range(4):
            assert torch.equal(rpc.rpc_sync("worker1", echo, args=(x + k,)), x + k)
        act = shut_down_wakeups_from if how == "shutdown" else passes_descriptor_on_wakeups_from
        out["misused"] = rpc.rpc_sync("worker1", act, args=(os.getpid(), 0.3))
        # Once the misuse was refused (polled: a loaded host runs worker1's
        # timer late), the loop's CPU over a second.
        deadline = time.monotonic() + 30
        while (int(rpc.api._get_current_rpc_agent().get_metrics()[
                "rpc_ext.peer.worker1.rejected_frames"]) < 1 and time.monotonic() < deadline):
            time.sleep(0.05)
        cpu = loop_cpu_seconds()
        time.sleep(1.0)
        # The loop did not spin on the ended socket: a spinning loop takes
        # ~1 s of CPU a second.
        out["loop_cpu"] = loop_cpu_seconds() - cpu
        metrics = rpc.api._get_current_rpc_agent().get_metrics()
        out["rejected"] = int(metrics["rpc_ext.peer.worker1.rejected_frames"])
        out["again"] = torch.equal(rpc.rpc_sync("worker1", echo, args=(x + 1,)), x + 1)
    rpc.shutdown()
    return out


@pytest.mark.parametrize("how", ["shutdown", "descriptor"])
def test_a_peer_that_misuses_a_ring_wake_up_loses_its_connection_not_our_loop(how):
    """shutdown: the socket reads as ended for good (a loop watching it
    would spin); descriptor: a byte carrying a descriptor, which a plain
    recv() would have had the kernel drop and close on our loop thread."""
    out = run_world(misused_wakeup, how=how)[0]
    assert out["misused"] == 1, out
    assert out["rejected"] >= 1, out
    assert out["loop_cpu"] < 0.3, out
    assert out["again"], out
