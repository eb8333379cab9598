# SPDX-License-Identifier: BSD-3-Clause
"""A handshake the peer stops answering is closed after handshake_timeout,
and the reason names what was awaited: a peer that never read our hello
(no challenge) is not one that stalled before its proof. (CI once lost a
connection to `nothing from the peer for 20007 ms` on a host with 93
runnable tasks, and nothing said at which step.)"""

import os
import socket
import struct
import time

import pytest

from torch_rpc_ext import _testing
from torch_rpc_ext.testing import (
    CHALLENGE,
    HELLO,
    connect_raw,
    frame_header,
    recv_exact,
)

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32
TIMEOUT_S = 0.3  # on a saturated host it may run to 2x, and late


def closed_for(ep) -> str:
    assert not ep.wait_ready(20)
    return ep.close_reason()


def test_a_peer_that_never_answers_our_hello():
    name = "torch_rpc_ext-stall-%d" % os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    ep = _testing.Endpoint(0, 2, KEY, "shm", [], handshake_timeout=TIMEOUT_S)
    try:
        ep.connect("@" + name, 1)
        listener.settimeout(20)
        silent, _ = listener.accept()  # accepted, never read
        reason = closed_for(ep)
        silent.close()
    finally:
        ep.close(0)
        listener.close()
    assert "handshake did not complete in time" in reason, reason
    assert "waiting for its challenge" in reason, reason


def test_a_listener_that_never_takes_our_connection():
    """Over TCP, a listener whose queue is full drops our SYN: our socket is
    never connected, and the reason says that (not: connected, and its
    writable event never handled by our loop, the other way to stay here)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # Linux queues one; the SYNs after it are dropped
    address = listener.getsockname()
    fillers = []
    ep = _testing.Endpoint(0, 2, KEY, "tcp", [], handshake_timeout=TIMEOUT_S)
    try:
        for _ in range(2):
            fillers.append(socket.socket())
            fillers[-1].setblocking(False)
            fillers[-1].connect_ex(address)
        ep.connect("127.0.0.1:%d" % address[1], 1)
        reason = closed_for(ep)
    finally:
        ep.close(0)
        for s in fillers:
            s.close()
        listener.close()
    assert "handshake did not complete in time" in reason, reason
    assert ("waiting for the connection to be accepted (our socket is not writable yet; "
            "loop takeovers ") in reason, reason


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_frame_queued_while_our_connect_completes_does_not_strand_it(monkeypatch, transport):
    """A frame queued while our loop is stalled before it starts the
    connection (TORCH_RPC_EXT_TEST_PAUSE_CONNECTING_MS) waits, and goes
    once the connection is ready, as an agent's call to a peer it is
    dialing does. (A plain frame flushes nothing before kReady; a staged
    device segment does: test_staged_channel.py.)"""
    monkeypatch.setenv("TORCH_RPC_EXT_TEST_PAUSE_CONNECTING_MS", "1000")
    server = _testing.Endpoint(1, 2, KEY, transport, [], handshake_timeout=5)
    client = _testing.Endpoint(0, 2, KEY, transport, [], handshake_timeout=5)
    try:
        client.connect(server.address, 1)
        time.sleep(0.4)  # the client's loop is in the pause now
        client.send(b"early", [])
        assert client.wait_ready(15), client.close_reason()
        assert server.wait_ready(15), server.close_reason()
        assert server.receive(15) == (b"early", [])
    finally:
        client.close(0)
        server.close(0)


@pytest.mark.parametrize("stop_after", ["connect", "hello"])
def test_a_client_that_stalls_mid_way(stop_after):
    # Our hello must arrive inside the timeout for the proof to be what is
    # awaited: 2 s leaves a loaded host room for that.
    timeout = 2.0 if stop_after == "hello" else TIMEOUT_S
    ep = _testing.Endpoint(1, 2, KEY, "shm", [], handshake_timeout=timeout)
    try:
        sock = connect_raw(ep.address, timeout=20)
        if stop_after == "hello":
            hello = struct.pack("<iQ", 0, 0) + os.urandom(32)
            sock.sendall(frame_header(HELLO, len(hello)) + hello)
            assert struct.unpack("<IBBHIIQ", recv_exact(sock, 24))[2] == CHALLENGE
            recv_exact(sock, 44)
        else:
            # One byte of the hello: not a knock (closed before its first
            # byte), a client that stopped.
            sock.sendall(frame_header(HELLO, 44)[:1])
        reason = closed_for(ep)
        sock.close()
    finally:
        ep.close(0)
    assert "handshake did not complete in time" in reason, reason
    awaited = "its proof" if stop_after == "hello" else "its hello"
    assert f"waiting for {awaited}" in reason, reason
