# SPDX-License-Identifier: BSD-3-Clause
"""A peer that sends its last frames and closes at once, before our next
write to it: that write fails (the peer's socket is gone), and what the
peer sent before it closed is still delivered, then the connection closes.

Seen on a starved host (CI's second lane, 93 runnable tasks): the accepting
end, descheduled between writing its proof and its frame ring's offer, came
back to a client that had verified that proof, sent its frames and closed;
the offer's write failed with EPIPE, and the connection closed with the
frames unread in its socket: never ready, nothing delivered.

Here the peer is a raw socket and our end an Endpoint in a child process,
stopped (SIGSTOP) while the peer sends its proof and a frame and closes:
once continued, our end reads both and its next write fails, every time."""

import fcntl
import multiprocessing as mp
import os
import selectors
import signal
import socket
import struct
import termios
import threading
import time

import pytest

from tests.rpc.world import stop_process
from torch_rpc_ext.testing import (
    CHALLENGE,
    HELLO,
    MESSAGE,
    PROOF,
    _proof,
    connect_raw,
    frame_header,
    hello_and_challenge,
    recv_exact,
)

pytestmark = pytest.mark.timeout(90)

KEY = b"k" * 32  # the Endpoint keys its proofs with the secret as given
LAST = b"last words"


def endpoint(role, transport, address, conn):
    """Our end: accepts (and publishes its address) or dials `address`;
    reports (ready?, the frame it received or None, its close reason)."""
    from torch_rpc_ext import _testing

    ep = _testing.Endpoint(0 if role == "dialing" else 1, 2, KEY, transport, [])
    conn.send(ep.address)
    if role == "dialing":
        assert conn.recv() == "dial"
        ep.connect(address, 1)
    conn.send(outcome(ep))
    ep.close(0)


def outcome(ep):
    """(ready?, the frame received or None, the close reason, the frames
    read from the peer's ring) once the connection closed: the peer is gone,
    so it closes once its frames are read."""
    ready = ep.wait_ready(30)
    got = ep.receive(10) if ready else None
    deadline = time.monotonic() + 10
    while ready and not ep.close_reason() and time.monotonic() < deadline:
        time.sleep(0.01)
    ring_reads = ep.counters()["transport"]["frame_ring_reads"]
    # The head, and the segments' bytes after it (none in most tests).
    got = got[0] + b"".join(got[1]) if got else None
    return ready, got, ep.close_reason(), ring_reads


def report(ours, child):
    """What our end (`child`) reported, once it has exited cleanly."""
    assert ours.poll(60), "our end reported nothing"
    got = ours.recv()
    child.join(30)
    assert child.exitcode == 0
    return got


def reap(child):
    if child.is_alive():
        child.kill()
        child.join(10)


def last_words():
    return frame_header(MESSAGE, len(LAST)) + LAST


def as_client(sock, pid):
    """The client's side: hello, the challenge, then (our end stopped) its
    proof and a frame at once, and gone."""
    cn, sid, sinc, sn = hello_and_challenge(sock)
    proof = _proof(KEY, b"client", cn, sn, 0, sid, 0, sinc)
    stop_process(pid)  # every thread: its loop's too
    sock.sendall(frame_header(PROOF, 32) + proof + last_words())
    sock.close()


def as_server(sock, pid):
    """The server's side: the challenge, then (our end stopped) its proof,
    once the client's checks out, and a frame at once, and gone."""
    assert struct.unpack("<IBBHIIQ", recv_exact(sock, 24))[2] == HELLO
    body = recv_exact(sock, 44)
    cid, cinc = struct.unpack("<iQ", body[:12])
    cn, sn = body[12:], os.urandom(32)
    sock.sendall(frame_header(CHALLENGE, 44) + struct.pack("<iQ", 1, 0) + sn)
    assert struct.unpack("<IBBHIIQ", recv_exact(sock, 24))[2] == PROOF
    assert recv_exact(sock, 32) == _proof(KEY, b"client", cn, sn, cid, 1, cinc, 0)
    stop_process(pid)  # every thread: its loop's too
    sock.sendall(frame_header(PROOF, 32) + _proof(KEY, b"server", cn, sn, cid, 1, cinc, 0)
                 + last_words())
    sock.close()


def listener(transport):
    """A raw listening socket, and the address our end dials."""
    if transport == "tcp":
        s = socket.create_server(("127.0.0.1", 0))
        return s, "127.0.0.1:%d" % s.getsockname()[1]
    name = "torch_rpc_ext-last-words-%d" % os.getpid()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\0" + name)
    s.listen(1)
    return s, "@" + name


@pytest.mark.parametrize(
    "role,transport",
    [("accepting", "shm"), ("accepting", "tcp"), ("dialing", "shm"), ("dialing", "tcp")],
)
def test_frames_sent_just_before_the_peer_closed_are_delivered(role, transport):
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    raw, address = listener(transport) if role == "dialing" else (None, None)
    child = ctx.Process(target=endpoint, args=(role, transport, address, theirs))
    child.start()
    try:
        assert ours.poll(30), "our end did not start"
        our_address = ours.recv()
        if role == "accepting":
            as_client(connect_raw(our_address, timeout=30), child.pid)
        else:
            raw.settimeout(30)
            ours.send("dial")
            sock, _ = raw.accept()
            sock.settimeout(30)
            as_server(sock, child.pid)
        os.kill(child.pid, signal.SIGCONT)
        ready, got, reason, _ = report(ours, child)
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.join(10)
        if raw is not None:
            raw.close()
    assert ready, f"our end never became ready: {reason}"
    assert got == LAST, reason
    assert reason == "peer closed the connection"  # and then it closed


def paused_acceptor(conn):
    """Our end as CI's receiver was: it stalls between its proof and its
    frame ring's offer, long enough for the client to finish and go."""
    os.environ["TORCH_RPC_EXT_TEST_PAUSE_AFTER_PROOF_MS"] = str(PAUSE_MS)
    from torch_rpc_ext import _testing

    ep = _testing.Endpoint(1, 2, KEY, "shm", [])
    conn.send(ep.address)
    conn.send(outcome(ep))
    ep.close(0)


PAUSE_MS = 3000


@pytest.mark.parametrize("body_bytes", [0, 1 << 20], ids=["head", "body_on_socket"])
def test_a_clients_frames_in_its_ring_arrive_though_our_ring_offer_meets_it_gone(body_bytes):
    """CI's sequence with two Endpoints: the client verifies our proof,
    offers its frame ring, sends its frame through it and closes, all while
    we are stalled; our ring offer then fails with EPIPE, and the client's
    ring, its descriptor still in our socket, is read to its end. A frame
    with a body of 1 MiB sends its header through the ring and the body on
    the socket, right behind the ring's own frame: our end reads it with
    that frame, before it has the ring that says what it is, and keeps it
    for the frame (`socketStash_`)."""
    import torch

    from torch_rpc_ext import _testing

    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=paused_acceptor, args=(theirs,))
    child.start()
    try:
        assert ours.poll(30), "our end did not start"
        client = _testing.Endpoint(0, 2, KEY, "shm", [])
        client.connect(ours.recv(), 1)
        assert client.wait_ready(30), client.close_reason()
        body = torch.randint(0, 256, (body_bytes,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(7))
        client.send(LAST, [(body.data_ptr(), body_bytes, 0, -1, 0)] if body_bytes else [])
        sent = client.counters()["transport"]
        client.close(5)
        ready, got, reason, ring_reads = report(ours, child)
    finally:
        reap(child)
    assert sent["frame_ring_writes"] >= 1  # the client's frame went through its ring
    assert sent["frame_ring_socket_bodies"] == (1 if body_bytes else 0), sent
    assert ready, f"our end never became ready: {reason}"
    expected = LAST + body.numpy().tobytes()
    assert got == expected and ring_reads >= 1, (len(got or b""), ring_reads, reason)
    assert reason == "peer closed the connection"


class ResettingRelay:
    """Forwards one connection to `target`; when the target's end closes,
    it forwards all the target sent and then resets the dialer's socket
    (SO_LINGER 0): the dialer's next write is refused (ECONNRESET) with the
    target's last bytes still unread in its socket. `reset_at`: when (on
    time.monotonic(), which every process shares)."""

    def __init__(self, target):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.reset_at = None
        self.error = None
        self.sockets = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.listener.settimeout(60)
            ours, _ = self.listener.accept()
            self.sockets.append(ours)
            theirs = socket.create_connection(self.target, timeout=60)
            self.sockets.append(theirs)
            self._forward(ours, theirs)
        except Exception as e:  # noqa: BLE001 - close() raises it in the test
            self.error = e
        finally:
            for sock in self.sockets:
                sock.close()  # a reset where SO_LINGER 0 was set

    def _forward(self, ours, theirs):
        with selectors.DefaultSelector() as sel:
            sel.register(ours, selectors.EVENT_READ, theirs)
            sel.register(theirs, selectors.EVENT_READ, ours)
            while events := sel.select(timeout=60):
                for key, _ in events:
                    try:
                        data = key.fileobj.recv(65536)
                    except OSError:
                        data = b""
                    if not data:
                        if key.fileobj is theirs:
                            delivered(ours)
                            ours.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                            struct.pack("ii", 1, 0))
                            ours.close()
                            self.reset_at = time.monotonic()
                        return
                    key.data.sendall(data)

    def close(self):
        for sock in [self.listener, *self.sockets]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's call
            except OSError:
                pass
        self.thread.join(30)
        self.listener.close()
        if self.error is not None:
            raise self.error


def delivered(sock, timeout=10):
    """Waits until the peer has acknowledged all `sock` sent: a reset
    discards what is still queued (a small send may wait there, corked
    behind the one before), and the test is about bytes that arrived."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        unsent = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
        if struct.unpack("i", unsent)[0] == 0:
            return
        time.sleep(0.001)
    raise AssertionError("the relay's bytes were not acknowledged in time")


def tls_dialer(encryption, conn):
    """Our end dials through the relay with a frame of its own queued, and
    stalls once the proofs are through (as a descheduled loop would): its
    first write after that, the queued frame, comes after the peer has sent
    its last frame and gone. Reports when it saw itself ready (after the
    stall and that write), and outcome()."""
    os.environ["TORCH_RPC_EXT_TEST_PAUSE_AFTER_PROOF_MS"] = str(PAUSE_MS)
    from torch_rpc_ext import _testing

    ep = _testing.Endpoint(0, 2, KEY, "tcp", [], encryption=encryption)
    ep.connect(conn.recv(), 1)
    ep.send(b"ours", [])  # queued: the connection is not ready yet
    ready_at = time.monotonic() if ep.wait_ready(30) else None
    conn.send((ready_at, outcome(ep)))
    ep.close(0)


@pytest.mark.parametrize("encryption", ["off", "always"])
def test_frames_a_peer_sent_before_it_closed_arrive_though_our_write_is_refused(encryption):
    """Over TLS too: our records go out through a buffer of ours, not
    OpenSSL's socket BIO, so a refused send leaves the TLS session whole and
    the peer's last records are still read and decrypted (before, over TLS
    the refused write closed the connection at once and the frame was
    lost: 'our end never became ready')."""
    from torch_rpc_ext import _testing

    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=tls_dialer, args=(encryption, theirs))
    child.start()
    theirs.close()  # the child's now: poll() sees it die
    server = relay = None
    try:
        server = _testing.Endpoint(1, 2, KEY, "tcp", [], encryption=encryption)
        relay = ResettingRelay(server.address)
        ours.send(relay.address)
        assert server.wait_ready(30), server.close_reason()
        if encryption == "always":
            assert server.security().startswith("TLS"), server.security()
        server.send(LAST, [])
        server.close(5)  # once written: the relay then resets our end
        ready_at, (ready, got, reason, _) = report(ours, child)
    finally:
        reap(child)
        if server is not None:
            server.close(0)
        if relay is not None:
            relay.close()
    assert ready, f"our end never became ready: {reason}"
    assert got == LAST, reason
    assert reason.startswith("peer closed the connection"), reason
    # What makes the case: the reset came while our end stalled, before
    # its write (a host too loaded for that would prove nothing here).
    assert relay.reset_at is not None and relay.reset_at < ready_at, (
        relay.reset_at,
        ready_at,
    )
