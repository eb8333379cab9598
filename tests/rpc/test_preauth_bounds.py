# SPDX-License-Identifier: BSD-3-Clause
"""Before a peer proves the secret it gets little (issue 45): a local
socket from another user is closed unanswered, idle sockets neither
exhaust a worker's descriptors into a spin nor keep a real peer out."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from torch_rpc_ext.testing import (
    HELLO,
    closed_by_peer,
    connect_raw,
    frame_header,
    handshake,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = b"0123456789abcdefghijklmnopqrstuv"
NOBODY = 65534

pytestmark = pytest.mark.timeout(180)

# One worker alone (world_size 1) that prints its addresses, then its
# counters and CPU time each time it reads a line, until stdin closes.
WORKER = """
    import json, os, resource, sys, time
    nofile = int(sys.argv[2])
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    import torch.distributed.rpc as rpc
    import torch_rpc_ext
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    opts = torch_rpc_ext.RpcExtBackendOptions(
        secret=%r, address="127.0.0.1", num_worker_threads=2,
        **{"handshake_timeout": 2, **json.loads(sys.argv[3])})
    rpc.init_rpc("worker0", rank=0, world_size=1,
                 backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)
    agent = rpc.api._get_current_rpc_agent()
    info = agent.get_debug_info()
    print(json.dumps({"tcp": info["rpc_ext.listen.tcp"], "shm": info["rpc_ext.listen.shm"]}),
          flush=True)
    for line in sys.stdin:
        m = agent.get_metrics()
        t = os.times()
        print(json.dumps({"cpu": t.user + t.system,
                          "closed": int(m["rpc_ext.tcp.unauthenticated_closed"])}), flush=True)
    rpc.shutdown()
""" % SECRET


class Worker:
    def __init__(self, nofile: int = 0, **options):
        from tests.rpc.world import free_port

        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WORKER), str(free_port()), str(nofile),
             json.dumps(options)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": ROOT},
        )
        self.addresses = json.loads(self.proc.stdout.readline())

    def stats(self) -> dict:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> str:
        try:
            _, err = self.proc.communicate(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return err


def _hello_as(uid: int, address: str) -> str:
    """In a child that runs as `uid`: connect to the shm address and send a
    hello; "challenge" if the worker answered, "closed" if it hung up."""
    code = textwrap.dedent(f"""
        import os, socket, struct, sys
        from torch_rpc_ext.testing import HELLO, connect_raw, frame_header
        os.setgid({uid}); os.setuid({uid})  # after the imports: root's files
        body = struct.pack("<iQ", 0, 0) + os.urandom(32)
        try:
            s = connect_raw({address!r})
            # (a refused peer may be closed before its hello is sent)
            s.sendall(frame_header(HELLO, len(body)) + body)
            print("challenge" if s.recv(24) else "closed")
        except OSError:
            print("closed")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_a_local_peer_of_another_user_is_closed_unanswered():
    """The shm socket is in the abstract namespace, open to every local
    process: one of another user gets no challenge (no HMAC to guess the
    secret against); one of ours, or any once shm_peers_any_user, does."""
    w = Worker()
    try:
        assert _hello_as(NOBODY, w.addresses["shm"]) == "closed"
        sock, ok = handshake(w.addresses["shm"], SECRET)
        assert ok
        sock.close()
    finally:
        err = w.stop()
    assert f"runs as uid {NOBODY}, this worker as uid 0" in err
    w = Worker(shm_peers_any_user=True)
    try:
        assert _hello_as(NOBODY, w.addresses["shm"]) == "challenge"
    finally:
        w.stop()


def _cpu_over(w: Worker, seconds: float) -> float:
    start = w.stats()["cpu"]
    time.sleep(seconds)
    return w.stats()["cpu"] - start


@pytest.mark.parametrize("nofile", [256, 100])
def test_idle_sockets_neither_spin_the_loop_nor_keep_a_real_peer_out(nofile):
    """300 sockets that connect and say nothing, against a worker limited to
    `nofile` descriptors: with 256 the per-host cap (128) closes the oldest
    first; with 100 it runs out of descriptors first, and pauses its
    listener instead of spinning, closing the oldest unauthenticated
    connection. Either way its CPU stays low, the log says it a bounded
    number of times, and a real peer still gets through."""
    w = Worker(nofile=nofile)
    idle = []
    try:
        host, port = w.addresses["tcp"].rsplit(":", 1)
        for _ in range(300):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, int(port)))
            idle.append(s)
        time.sleep(1)  # the worker accepts what it can, then runs out
        cpu = _cpu_over(w, 3.0)
        assert cpu < 1.0, f"the worker used {cpu:.2f} s of CPU in 3 s with idle sockets open"
        deadline = time.monotonic() + 30
        while True:
            try:
                sock, ok = handshake(w.addresses["tcp"], SECRET)
                assert ok
                sock.close()
                break
            except (ConnectionError, OSError):
                assert time.monotonic() < deadline, "a real peer never got in"
                time.sleep(0.5)
        assert w.stats()["closed"] > 0
    finally:
        for s in idle:
            s.close()
        err = w.stop()
    # Said, but not once per failed accept or per closed connection.
    if nofile == 100:
        assert "Too many open files" in err
    assert err.count("Too many open files") < 10, err[-3000:]
    assert err.count("refused connection") < 10, err[-3000:]


def test_unauthenticated_connections_past_the_cap_close_the_oldest():
    """Quiet sockets from one host beyond the per-host cap: the oldest are
    closed, the newest kept; a real peer from that host gets through. (The
    newest are checked ~1.5 s after they connect, on a loaded host later:
    a handshake timeout of 10 s, not 2, leaves them open that long.)"""
    w = Worker(handshake_timeout=10)
    try:
        host, port = w.addresses["tcp"].rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(140)]
        # Until the cap closed the oldest 12 (polled: a loaded host's loop
        # is late), well inside the 10 s handshake timeout.
        deadline = time.monotonic() + 6
        while w.stats()["closed"] < 140 - 128 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.stats()["closed"] >= 140 - 128
        idle[0].settimeout(2)
        assert closed_by_peer(idle[0])
        idle[-1].settimeout(0.3)
        assert not closed_by_peer(idle[-1])
        sock, ok = handshake(w.addresses["tcp"], SECRET)
        assert ok
        sock.close()
        for s in idle:
            s.close()
    finally:
        w.stop()


def _evicted_and_the_peer_still_proves(w, peer, challenge, evicted):
    """Waits until the worker closed `evicted` unauthenticated connections
    to make room, then proves the secret on the real peer's `peer` (whose
    hello got `challenge`): its handshake was kept, the server proves back."""
    import hmac
    import struct

    from torch_rpc_ext.testing import PROOF, _proof, _stretched, recv_exact

    deadline = time.monotonic() + 6
    while w.stats()["closed"] < evicted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.stats()["closed"] >= evicted
    cn, sid, sinc, sn = challenge
    proof = _proof(_stretched(SECRET), b"client", cn, sn, 0, sid, 0, sinc)
    peer.sendall(frame_header(PROOF, 32) + proof)
    got = recv_exact(peer, 24 + 32)  # the server's proof: still there
    assert struct.unpack("<IBBHIIQ", got[:24])[2] == PROOF
    assert hmac.compare_digest(
        got[24:], _proof(_stretched(SECRET), b"server", cn, sn, 0, sid, 0, sinc))
    peer.close()


def test_sources_that_fill_the_cap_between_them_close_their_own():
    """Five addresses under the per-source cap fill the overall one (512)
    while a real peer's handshake is under way: the one closed to make room
    is the oldest of the source holding the most, not the oldest of all (the
    real peer's, before: a few thousand connections a second from five
    addresses kept every peer from authenticating)."""
    from torch_rpc_ext.testing import hello_and_challenge

    w = Worker(handshake_timeout=10)
    idle = []
    try:
        host, port = w.addresses["tcp"].rsplit(":", 1)
        # The real peer first (the oldest of all): its hello, the challenge.
        peer = socket.create_connection((host, int(port)), timeout=5)
        challenge = hello_and_challenge(peer)
        # 127.0.0.2 holds the most (120), four others 100 each: 521 with
        # the peer, 9 past the cap.
        for source, n in (("127.0.0.2", 120), ("127.0.0.3", 100), ("127.0.0.4", 100),
                          ("127.0.0.5", 100), ("127.0.0.6", 100)):
            idle += [socket.create_connection((host, int(port)), timeout=5,
                                              source_address=(source, 0)) for _ in range(n)]
        _evicted_and_the_peer_still_proves(w, peer, challenge, evicted=9)
        # Those closed were 127.0.0.2's oldest.
        idle[0].settimeout(2)
        assert closed_by_peer(idle[0])
        idle[120].settimeout(0.3)  # 127.0.0.3's first
        assert not closed_by_peer(idle[120])
    finally:
        for s in idle:
            s.close()
        w.stop()


def test_a_prober_with_an_address_per_connection_closes_its_own_oldest():
    """Past the overall cap (512), sources that hold as many connections (a
    prober with an address for each, tied with a real peer at one) lose the
    oldest of them: the prober's silent ones, not the peer's handshake under
    way (before, an arbitrary one of the tied sources)."""
    from torch_rpc_ext.testing import hello_and_challenge

    w = Worker(handshake_timeout=10)
    idle = []
    sources = (f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(1000))

    def silent(n):
        return [socket.create_connection((host, int(port)), timeout=5,
                                         source_address=(next(sources), 0)) for _ in range(n)]

    try:
        host, port = w.addresses["tcp"].rsplit(":", 1)
        idle += silent(256)
        # The real peer, younger than those: its hello, the challenge.
        peer = socket.create_connection((host, int(port)), timeout=5)
        challenge = hello_and_challenge(peer)
        # 264 more: 521 in all with the peer, 9 past the cap.
        idle += silent(264)
        _evicted_and_the_peer_still_proves(w, peer, challenge, evicted=9)
        # Those closed were the nine oldest.
        for s in idle[:9]:
            s.settimeout(2)
            assert closed_by_peer(s)
        idle[9].settimeout(0.3)
        assert not closed_by_peer(idle[9])
    finally:
        for s in idle:
            s.close()
        w.stop()


def test_a_hello_on_a_plain_socket_still_gets_a_challenge():
    """The bounds leave the protocol alone: a hello from our own user over
    the shm socket and over tcp is answered."""
    w = Worker()
    try:
        for address in (w.addresses["shm"], w.addresses["tcp"]):
            s = connect_raw(address)
            body = b"\0" * 12 + os.urandom(32)
            s.sendall(frame_header(HELLO, len(body)) + body)
            assert len(s.recv(24)) > 0
            s.close()
    finally:
        w.stop()


# Another user's process on an abstract name (as one could bind the name of a
# worker that exited): it accepts one connection and says how many bytes came.
LISTENER_AS = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
s.bind("\\0" + sys.argv[1])
s.listen(1)
print("listening", flush=True)
s.settimeout(30)
got = b""
for _ in range(2):  # the knock, then the dial
    c, _ = s.accept()
    c.settimeout(3)
    try:
        while True:
            chunk = c.recv(65536)
            if not chunk:
                break
            got += chunk
    except socket.timeout:
        pass
    c.close()
print(len(got), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")
def test_a_local_listener_of_another_user_gets_no_hello():
    """Only accepted connections were checked: dialling an abstract name
    another user had bound sent it our hello, then our proof (material to
    test guesses of the secret against), and its knock answers made a dead
    worker look alive (a knock it accepts)."""
    from torch_rpc_ext import _testing

    name = f"torch_rpc_ext-squat-{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", LISTENER_AS, name, str(NOBODY)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "listening", child.stderr.read()
        ep = _testing.Endpoint(0, 2, b"k" * 32, "shm", [], handshake_timeout=5)
        try:
            # A knock (a liveness check's) finds no worker there.
            (knock,) = ep.knock(["@" + name], 5.0)
            ep.connect("@" + name, 1)
            ready = ep.wait_ready(10)
            reason = ep.close_reason()
        finally:
            ep.close(0)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert knock[0] == "refused" and f"runs as uid {NOBODY}" in knock[1], knock
    assert not ready and f"runs as uid {NOBODY}, this worker as uid 0" in reason, reason
    assert out.strip() == "0", (out, err)


def test_a_local_dial_that_finds_the_listeners_backlog_full_dials_again():
    """A Unix socket's connect fails with EAGAIN while the listener's
    backlog is full (a burst of local dialers, its loop busy): the call
    failed at once, "Resource temporarily unavailable", where a moment later
    the dial went through. Now it dials again within the handshake
    timeout: here a listener of ours with a backlog of one, filled, then
    drained after half a second."""
    from torch_rpc_ext import _testing

    name = f"torch_rpc_ext-backlog-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(0)  # one connection may wait: the filler's
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    filler.connect("\0" + name)
    ep = _testing.Endpoint(0, 2, b"k" * 32, "shm", [], handshake_timeout=10)
    try:
        ep.connect("@" + name, 1)
        time.sleep(0.5)
        reason = ep.close_reason()
        listener.settimeout(10)
        listener.accept()[0].close()  # the filler's: room for one more
        dialled, _ = listener.accept()
        dialled.settimeout(10)
        hello = dialled.recv(64)  # the dialler speaks first
        dialled.close()
    finally:
        ep.close(0)
        filler.close()
        listener.close()
    assert reason == "", reason
    assert len(hello) > 0
