# SPDX-License-Identifier: BSD-3-Clause
"""tcp_lanes on a hostile network (issue 45, docs/security.md): two
transport endpoints (``_testing.Endpoint``, TLS always) whose connection
and whose lanes pass through relays of ours. The endpoints listen on
127.0.0.1; the client dials the server at 127.0.0.2, so its lanes dial
127.0.0.2 too (a lane goes to the connection's peer address), where the
test listens on each lanes port the server opened and forwards to
127.0.0.1: a man in the middle of every byte, as a router would be.

What it tries: a lane hello seen on the wire, replayed on a connection of
its own (the hello answers a challenge of the listener's, so it proves
nothing on another one); a record altered and a record replayed (each
closes that connection, and only it); lane keys replaced by volume; a
source that keeps sending hellos that prove nothing is held off."""

import contextlib
import ctypes
import os
import re
import selectors
import socket
import struct
import threading
import time

import pytest

from tests.rpc.slow_pages import SlowPages
from tests.rpc.test_lanes import _listening_ports
from tests.rpc.test_last_words import delivered
from tests.rpc.test_tls_wire import pump

_testing = pytest.importorskip("torch_rpc_ext._testing")

pytestmark = pytest.mark.timeout(120)

SECRET = "lanes-wire-" + "x" * 24
MB = 1 << 20
HELLO_BYTES = 40  # magic, version, lane, ticket, MAC (lane.h)
CHALLENGE_BYTES = 16
ADMITTED = b"\x41"  # the listener's answer to a hello it took (lane.h)
HEADER_BYTES = 32  # a chunk's header; an encrypted record adds a 16-byte tag


def endpoint(self_id, **options):
    return _testing.Endpoint(self_id, 2, SECRET, "tcp", ["tcp_lanes"], encryption="always",
                             **options)


def lanes(ep):
    return ep.counters()["tcp_lanes"]


def recv_exact(sock, n, timeout=5.0):
    """`n` bytes, or fewer if the peer closes or stays silent `timeout` s."""
    sock.settimeout(timeout)
    got = b""
    try:
        while len(got) < n and (chunk := sock.recv(n - len(got))):
            got += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return got


def closed_within(sock, seconds):
    """Whether the peer closes `sock` within `seconds` (what it sends first
    is read and dropped)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _as_is(offset, data):
    return data


def take_hello(dialler, upstream):
    """Relays the listener's challenge to the dialler and returns the hello
    it answers with, not passed on (the caller decides)."""
    dialler.sendall(recv_exact(upstream, CHALLENGE_BYTES))
    hello = recv_exact(dialler, HELLO_BYTES)
    for sock in (dialler, upstream):
        sock.settimeout(None)  # (recv_exact's) a splice waits as long as it takes
    return hello


def pass_hello(dialler, upstream, hello):
    """Passes `hello` on and relays the listener's answer (its admission)."""
    upstream.sendall(hello)
    answer = recv_exact(upstream, 1)
    assert answer == ADMITTED, answer
    upstream.settimeout(None)
    dialler.sendall(answer)


def splice(a, b, mangle_up=_as_is):
    """Both ways between `a` (the dialler) and `b`, in threads (pump:
    test_tls_wire.py's)."""
    threading.Thread(target=pump, args=(a, b, mangle_up), daemon=True).start()
    threading.Thread(target=pump, args=(b, a, _as_is), daemon=True).start()


class Tap:
    """Listens on 127.0.0.2:`port` (0: any) and hands each connection, with
    a fresh one to 127.0.0.1:`target`, to `handle(dialler, upstream,
    index)`."""

    def __init__(self, port, handle, target=None):
        self.target = target or port
        self.handle = handle
        self.listener = socket.create_server(("127.0.0.2", port))
        self.port = self.listener.getsockname()[1]
        self.count = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                dialler, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            upstream.settimeout(None)
            index, self.count = self.count, self.count + 1
            threading.Thread(target=self.handle, args=(dialler, upstream, index), daemon=True).start()

    def close(self):
        # shutdown() first: it wakes the accept() blocked in _accept's
        # thread. close() alone leaves that call holding the socket, still
        # listening on 127.0.0.2:port for the rest of the process, and a
        # later test whose endpoint got the same port number could not tap
        # it (EADDRINUSE).
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()


class Wired:
    """A server and a client connected through a relay at 127.0.0.2, with
    `lane_handler` tapping every lanes port the server opens (and
    `relay_handler`, if given, relaying the connection itself)."""

    def __init__(self, lane_handler, relay_handler=None, **options):
        self.kept = []
        self.server = endpoint(0, **options)
        self.client = endpoint(1, **options)
        self.server.set_peer(self.client.descriptors())
        self.client.set_peer(self.server.descriptors())
        ports_before = _listening_ports(os.getpid())
        host, port = self.server.address.rsplit(":", 1)
        assert host == "127.0.0.1", self.server.address
        self.relay = Tap(0, relay_handler or (lambda d, u, i: splice(d, u)), target=int(port))
        self.client.connect("127.0.0.2:%d" % self.relay.port, 0)
        assert self.client.wait_ready(30)
        self.client.send(b"first", [])
        assert self.server.receive(30) == (b"first", [])
        # The server's lanes listener (and the client's: both offer) is up
        # once the offers are out; tap every new port on 127.0.0.2.
        deadline = time.monotonic() + 10
        while len(new := _listening_ports(os.getpid()) - ports_before - {self.relay.port}) < 2:
            assert time.monotonic() < deadline, new
            time.sleep(0.02)
        self.taps = [Tap(p, lane_handler) for p in new]

    def send_big(self, size):
        """Sends `size` bytes; returns them. The endpoint sends from our
        memory by address: it is kept until close() (lanes read it from
        their threads after send() returns)."""
        payload = (bytes(range(256)) * (size // 256 + 1))[:size]
        buf = ctypes.create_string_buffer(payload, size)
        self.kept.append(buf)
        self.client.send(b"big", [(ctypes.addressof(buf), size, 0, 0, 0)])
        return payload

    def lanes_up(self, timeout=30):
        """Waits until the client's four lanes are dialled (until then
        large segments ride the stream)."""
        deadline = time.monotonic() + timeout
        while lanes(self.client)["lanes_opened"] < 4:
            assert time.monotonic() < deadline, lanes(self.client)
            time.sleep(0.02)

    def received(self, timeout=30):
        got = self.server.receive(timeout)
        if got is None:
            return None
        head, segments = got
        out = []
        for s in segments:
            out.append(s if isinstance(s, bytes) else ctypes.string_at(s.address, s.size))
        return head, out

    def close(self):
        for t in self.taps + [self.relay]:
            t.close()
        self.client.close(0)
        self.server.close(0)
        self.kept.clear()


def expect_only_that_connection_closed(w, what):
    """The server closed the tapped connection naming `what`, and a new
    connection (no relay) to it works."""
    assert w.server.receive(30) is None
    reason = w.server.close_reason()
    assert what in reason, reason
    other = endpoint(1)
    other.set_peer(w.server.descriptors())
    other.connect(w.server.address, 0)
    assert other.wait_ready(30)
    other.send(b"after", [])
    deadline = time.monotonic() + 30
    while (got := w.server.receive(1)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == (b"after", [])
    other.close(0)


def test_a_lane_hello_seen_on_the_wire_proves_nothing_on_another_connection():
    seen = {}

    def replay_first(dialler, upstream, index):
        if index > 0 or "hello" in seen:
            return splice(dialler, upstream)
        # Keep the hello the client answers with, and present it first on a
        # connection of our own.
        seen["hello"] = hello = take_hello(dialler, upstream)
        with socket.create_connection(("127.0.0.1", upstream.getpeername()[1]), timeout=5) as mine:
            # A fresh one, not answered (4 s, then up to 5 for the close:
            # under the held original's 10 s handshake timeout).
            fresh = recv_exact(mine, CHALLENGE_BYTES, timeout=4.0)
            assert len(fresh) == CHALLENGE_BYTES, f"no fresh challenge within 4 s: {fresh!r}"
            mine.sendall(hello)
            seen["replay_closed"] = closed_within(mine, 5)
        # The original then goes on, untouched: its hello answers its own
        # challenge, so the ticket it names was not spent by the replay.
        upstream.sendall(hello)
        splice(dialler, upstream)

    w = Wired(replay_first)
    try:
        payload = w.send_big(8 * MB)  # dials the lanes; rides the stream
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        payload = w.send_big(8 * MB)  # striped
        assert w.received() == (b"big", [payload])
        assert len(seen["hello"]) == HELLO_BYTES, seen
        assert seen["replay_closed"], "a replayed lane hello was admitted"
        counters = lanes(w.server)
        assert counters["hellos_refused"] == 1, counters
        assert lanes(w.client)["lanes_opened"] == 4 and counters["segments"] == 0
        assert lanes(w.client)["segments"] >= 1
    finally:
        w.close()


def tamper_after_hello(mutate):
    """A lane handler applying `mutate(record) -> bytes` to the first
    encrypted record of the first lane (the rest pass untouched)."""

    def handle(dialler, upstream, index):
        if index > 0:
            return splice(dialler, upstream)
        pass_hello(dialler, upstream, take_hello(dialler, upstream))
        header = recv_exact(dialler, HEADER_BYTES, timeout=30)
        length = int.from_bytes(header[24:28], "little")
        record = header + recv_exact(dialler, length + 16, timeout=30)
        upstream.sendall(mutate(record))
        splice(dialler, upstream)

    return handle


@pytest.mark.parametrize(
    "mutate,why",
    [
        # A bit of its ciphertext: the tag fails.
        (lambda r: r[:100] + bytes([r[100] ^ 1]) + r[101:], "failed its integrity check"),
        # Twice: its bytes were claimed already (were its header altered to
        # claim others, its tag would fail).
        (lambda r: r + r, "chunks overlap"),
    ],
    ids=["altered", "replayed"],
)
def test_a_lane_record_altered_or_replayed_closes_that_connection_only(mutate, why):
    w = Wired(tamper_after_hello(mutate))
    try:
        payload = w.send_big(8 * MB)  # dials the lanes; rides the stream
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        w.send_big(8 * MB)  # striped: lane 0's first record is tampered with
        expect_only_that_connection_closed(w, why)
    finally:
        w.close()


def test_lane_keys_are_replaced_by_volume(monkeypatch):
    # Two records under each key: 8 MiB in 256 KiB records over 4 lanes
    # is 8 records a lane, so 3 replacements a lane, each end.
    monkeypatch.setenv("TORCH_RPC_EXT_LANES_RECORDS_PER_KEY", "2")
    w = Wired(lambda d, u, i: splice(d, u))
    try:
        payload = w.send_big(8 * MB)
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        payload = w.send_big(8 * MB)
        assert w.received() == (b"big", [payload])
        ours, theirs = lanes(w.client), lanes(w.server)
        assert ours["segments"] == 1, ours
        assert ours["rekeys"] == theirs["rekeys"] == 4 * 3, (ours, theirs)
    finally:
        w.close()


def refused_lane_hellos(port, count, source="127.0.0.3"):
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
            recv_exact(s, CHALLENGE_BYTES, timeout=2)
            s.sendall(b"TRLN\x02\x00\x00\x00" + os.urandom(32))
            assert closed_within(s, 5)


def test_a_source_whose_hellos_prove_nothing_is_held_off():
    w = Wired(lambda d, u, i: splice(d, u))
    try:
        port = w.taps[0].port
        refused_lane_hellos(port, 8)  # a prober at 127.0.0.3
        counters = [lanes(w.server), lanes(w.client)]
        assert sum(c["sources_held_off"] for c in counters) == 1, counters
        # Held off: closed before any challenge.
        with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.3", 0)) as s:
            assert recv_exact(s, CHALLENGE_BYTES, timeout=2) == b""
        # Others are not: the lanes come up from 127.0.0.2 as before.
        payload = w.send_big(8 * MB)
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        payload = w.send_big(8 * MB)
        assert w.received() == (b"big", [payload])
        assert lanes(w.client)["segments"] == 1
    finally:
        w.close()


def test_an_exempt_source_s_lane_hellos_are_never_held_off():
    w = Wired(lambda d, u, i: splice(d, u), hold_off_exempt=["127.0.0.3"])
    try:
        port = w.taps[0].port
        refused_lane_hellos(port, 10)
        counters = [lanes(w.server), lanes(w.client)]
        assert sum(c["sources_held_off"] for c in counters) == 0, counters
        assert sum(c["hellos_refused"] for c in counters) == 10, counters
        assert sum(c["hold_off_exempt_failures"] for c in counters) == 10, counters
        # Still answered with a challenge.
        with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.3", 0)) as s:
            assert len(recv_exact(s, CHALLENGE_BYTES, timeout=2)) == CHALLENGE_BYTES
    finally:
        w.close()


def test_a_flood_of_silent_connections_closes_its_own_not_a_peers_hello():
    """Past the listener's 64 pending hellos, the oldest of the source holding
    the most goes (before session 98: the oldest of all, so a flood closed
    every lane dialled before it)."""
    w = Wired(lambda d, u, i: splice(d, u))
    flood = []
    try:
        port = w.taps[0].port
        # A peer's lane, its challenge read and its hello not yet written.
        peer = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.4", 0))
        assert len(recv_exact(peer, CHALLENGE_BYTES)) == CHALLENGE_BYTES
        accepted = time.monotonic()
        # A prober at 127.0.0.3 opens 70 and says nothing: once it holds
        # each one's challenge, the listener has made room for it.
        for _ in range(70):
            s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.3", 0))
            flood.append(s)
            assert len(recv_exact(s, CHALLENGE_BYTES)) == CHALLENGE_BYTES
        if time.monotonic() - accepted > 4:
            # The peer's own 5 s deadline would close it anyway: eviction
            # and timeout could not be told apart (a machine that slow).
            pytest.skip("the flood took over 4 s on this machine")
        # Places were made (71 for 64) by closing the prober's oldest, not
        # the peer's (the oldest of all, which the listener closed first
        # before session 98). (The counters are each endpoint's context's:
        # the port is the server's or the client's, both listen.)
        assert closed_within(flood[0], 5)
        counters = [lanes(w.server), lanes(w.client)]
        assert sum(c["hellos_evicted"] for c in counters) >= 1, counters
        assert not closed_within(peer, 0.1)
        peer.close()
    finally:
        for s in flood:
            s.close()
        w.close()


def test_mutated_hellos_are_all_refused_and_the_lanes_carry_on():
    """A small mutation fuzz of the lane hello against a live listener:
    a real hello (taken off the wire, as in the replay test above) with
    bytes flipped, cut short or extended, each on a connection of its own.
    Every one is refused; the prober's address ends up held off; the
    connection's own lanes carry on."""
    import random

    seen = {}

    def capture_first(dialler, upstream, index):
        if index > 0 or "hello" in seen:
            return splice(dialler, upstream)
        seen["hello"] = hello = take_hello(dialler, upstream)
        upstream.sendall(hello)
        splice(dialler, upstream)

    w = Wired(capture_first)
    try:
        payload = w.send_big(8 * MB)
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        hello = seen["hello"]
        tapped = next(t for t in w.taps if t.count > 0)  # the server's lanes
        port = tapped.port
        rng = random.Random(45)
        admitted = 0
        # Cut-short ones last: each waits out the listener's 5 s for a whole
        # hello (unless the prober is held off by then).
        for i in range(42):
            h = bytearray(hello)
            kind = 1 if i >= 40 else i % 2 * 2
            if kind == 0:
                for _ in range(rng.randint(1, 4)):
                    h[rng.randrange(len(h))] ^= rng.randrange(1, 256)
            elif kind == 1:
                del h[rng.randrange(len(h)):]
            else:
                h += os.urandom(rng.randint(1, 64))
            with socket.create_connection(("127.0.0.1", port), timeout=5,
                                          source_address=("127.0.0.3", 0)) as s:
                recv_exact(s, CHALLENGE_BYTES, timeout=2)
                try:
                    s.sendall(bytes(h))
                except OSError:
                    pass  # held off: closed before we wrote
                admitted += not closed_within(s, 7)
        assert admitted == 0
        counters = lanes(w.server)
        assert counters["hellos_refused"] >= 8 and counters["sources_held_off"] >= 1, counters
        payload = w.send_big(8 * MB)
        assert w.received() == (b"big", [payload])
        assert lanes(w.client)["segments"] == 1  # striped, on the lanes it has
    finally:
        w.close()


class ResettableLink:
    """The connection's relay: both ways until reset() resets the server's
    socket (SO_LINGER 0, once what it was sent is acknowledged), as a peer
    that exits does; the client's end stays open until close() (were it
    closed, the client would shut its lanes, stripes and all)."""

    def __init__(self):
        self.asked = threading.Event()
        self.done = threading.Event()
        self.sockets = []

    def __call__(self, dialler, upstream, index):
        self.sockets += [dialler, upstream]
        with selectors.DefaultSelector() as sel:
            sel.register(dialler, selectors.EVENT_READ, upstream)
            sel.register(upstream, selectors.EVENT_READ, dialler)
            while not self.asked.is_set():
                for key, _ in sel.select(timeout=0.02):
                    try:
                        data = key.fileobj.recv(65536)
                        if data:
                            key.data.sendall(data)
                    except OSError:
                        data = b""
                    if not data:
                        return
        delivered(upstream)
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        upstream.close()
        self.done.set()

    def reset(self):
        self.asked.set()
        assert self.done.wait(15), "the link did not reset"

    def close(self):
        self.asked.set()
        for sock in self.sockets:
            sock.close()


def wait_for(what, condition, timeout=15):
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("then_write", [False, True], ids=["reset", "reset_then_our_write"])
def test_a_striped_frame_arrives_though_its_connection_is_reset_before_its_stripes(then_write):
    """The record is on the connection, its bytes still on the lanes, when
    the connection's socket is reset (its peer exited after sending): the
    stripes still land, the frame is delivered, and then the connection
    closes. Before, the reset closed it at once (nothing is read while a
    record is held, and epoll reports a reset whatever is asked), and the
    frame was lost; so was it when a write of ours, refused, closed it."""
    flowing = threading.Event()
    flowing.set()

    def held_back(offset, data):
        flowing.wait(60)
        return data

    link = ResettableLink()
    w = Wired(lambda d, u, i: splice(d, u, held_back), relay_handler=link)
    try:
        payload = w.send_big(8 * MB)  # dials the lanes; rides the stream
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        flowing.clear()
        held = lanes(w.server)["held_records"]
        payload = w.send_big(8 * MB)  # striped: the lanes hold its bytes back
        wait_for("the server holding its record", lambda: lanes(w.server)["held_records"] > held)
        link.reset()
        if then_write:
            w.server.send(b"ours", [])  # refused: the socket was reset
        ends = lambda: w.server.counters()["transport"]["held_socket_ends"]  # noqa: E731
        wait_for("the server seeing the reset while it held the record", ends)
        flowing.set()
        assert w.received(15) == (b"big", [payload]), w.server.close_reason()
        reason = wait_for("the connection closing", w.server.close_reason)
        assert reason.startswith("peer closed the connection"), reason
        assert ends() == 1
    finally:
        flowing.set()
        link.close()
        w.close()


@pytest.mark.parametrize("listener", ["silent", "refuses"])
def test_a_lane_the_listener_did_not_admit_carries_nothing(listener):
    """Each lane's hello is taken by a middlebox: "silent" passes nothing on
    and keeps both ends open (the listener never saw it, as when it dropped
    the hello: its pending hellos full, no thread for the lane, a hello
    slower than its 5 s); "refuses" passes it on altered, and the listener
    closes the lane. The dialler used to count a lane up once its hello was
    written and stripe the next large segment onto it: lost in the silence,
    or a write refused that closed the whole connection. Now a lane is up
    only once the listener answers the hello (lane hello version 3); these
    fail, and large segments ride the stream."""
    held = []

    def handle(dialler, upstream, index):
        hello = take_hello(dialler, upstream)
        held.extend((dialler, upstream))
        if listener == "refuses":
            upstream.sendall(hello[:-1] + bytes([hello[-1] ^ 1]))  # its MAC
            splice(dialler, upstream)

    w = Wired(handle)
    try:
        payload = w.send_big(8 * MB)  # dials the lanes; rides the stream
        assert w.received() == (b"big", [payload])
        wait_for("the lanes to fail", lambda: lanes(w.client)["lanes_failed"] == 4, timeout=30)
        assert lanes(w.client)["lanes_opened"] == 0, lanes(w.client)
        payload = w.send_big(8 * MB)
        assert w.received() == (b"big", [payload])
        assert lanes(w.client)["segments"] == 0, lanes(w.client)
        assert w.client.close_reason() == "", w.client.close_reason()
        refused = 4 if listener == "refuses" else 0
        assert lanes(w.server)["hellos_refused"] == refused, lanes(w.server)
    finally:
        for sock in held:
            sock.close()
        w.close()


@pytest.fixture
def cpu_pressure():
    """Sets what the host's CPU pressure reads as (the stall check gives a
    saturated host more time): the real one varies with the machine's
    load, and tests that time a stall must not."""
    _testing.set_cpu_pressure(0.0)
    try:
        yield _testing.set_cpu_pressure
    finally:
        _testing.set_cpu_pressure(None)


def test_a_lane_that_stalls_is_named_when_its_frame_gives_up(cpu_pressure):
    """One lane stops moving (a middlebox keeps it open and forwards
    nothing more) while the other three deliver their stripes: the
    receiver holds the frame's record for the missing stripe. The
    connection closes twice heartbeat_timeout after the lanes went quiet,
    naming the segment and what each lane carried of it, not after six of
    them naming a peer that shows no sign of life (it was there on the
    stream all along)."""
    stalled = threading.Event()
    held = []

    def handle(dialler, upstream, index):
        pass_hello(dialler, upstream, take_hello(dialler, upstream))
        if index == 0:
            held.extend((dialler, upstream))  # open, and nothing more passes
            stalled.set()
            return
        splice(dialler, upstream)

    w = Wired(handle, heartbeat_timeout=2.0)
    try:
        payload = w.send_big(8 * MB)  # dials the lanes; rides the stream
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        assert stalled.is_set()
        w.send_big(64 * MB)  # 16 MiB a lane: more than the stalled one's buffers take
        assert w.server.receive(60) is None
        reason = w.server.close_reason()
        # Before: "no sign of life from the peer for 12.29 s", after six
        # timeouts (the peer's pings waited unread behind the held record).
        assert reason.startswith("tcp_lanes: segment 1 (67108864 bytes, "), reason
        assert "and no lane carried anything of it for 4.0 s (twice heartbeat_timeout)" in reason
        # 16 MiB a lane, but the one tapped (its index is the dialler's).
        by_lane = re.search(r"its bytes by lane: (.*): a lane stalled", reason)
        assert by_lane, reason
        carried = sorted(int(x.split(": ")[1]) for x in by_lane.group(1).split(", "))
        assert carried == [0, 16 * MB, 16 * MB, 16 * MB], reason
        assert lanes(w.server)["stalls"] == 1, lanes(w.server)
    finally:
        for sock in held:
            sock.close()
        w.close()


def stall_lane_zero():
    """A lane handler that holds the dialler's lane 0 open and forwards
    nothing of it past its hello (a middlebox that stopped it); the
    others are spliced. Returns the handler and what it holds."""
    held = []

    def handle(dialler, upstream, index):
        pass_hello(dialler, upstream, take_hello(dialler, upstream))
        if index == 0:
            held.extend((dialler, upstream))
            return
        splice(dialler, upstream)

    return handle, held


def stalled_segment_named(w, seconds, why):
    """The server closed the connection naming segment 1 (64 MiB), which
    lane 0 stalled, `seconds` after its lanes went quiet, because `why`."""
    assert w.server.receive(60) is None
    reason = w.server.close_reason()
    assert reason.startswith("tcp_lanes: segment 1 (67108864 bytes, "), reason
    assert "and no lane carried anything of it for %s (%s)" % (seconds, why) in reason, reason
    by_lane = re.search(r"its bytes by lane: (.*): a lane stalled", reason)
    assert by_lane, reason
    carried = sorted(int(x.split(": ")[1]) for x in by_lane.group(1).split(", "))
    assert carried == [0, 16 * MB, 16 * MB, 16 * MB], reason
    assert lanes(w.server)["stalls"] == 1, lanes(w.server)


def test_a_stalled_lane_is_named_while_the_other_lanes_carry_later_segments(cpu_pressure):
    """As above, but the client goes on sending 8 MiB frames after the one
    whose stripe stalled: the other three lanes carry the stripes of those
    (a receiver takes up to 4 GiB ahead of their records), so some lane is
    always moving. Only the lanes that may still owe the held segment
    bytes count: a lane that began a later segment's stripe has sent all
    of its share of the held one (a lane carries its stripes in order).
    Before, the moving lanes hid the stalled one, and their bytes kept the
    heartbeat content (lane progress is a sign of life): nothing closed the
    connection in the 60 s the test waits (not until 4 GiB of later
    segments had landed ahead of their records, over 100 s here), and the
    frame waited with every one behind it."""
    handle, held = stall_lane_zero()
    w = Wired(handle, heartbeat_timeout=2.0)
    stop = threading.Event()
    sender = None
    try:
        payload = w.send_big(8 * MB)  # dials the lanes; rides the stream
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        w.send_big(64 * MB)
        later = ctypes.create_string_buffer(8 * MB)
        w.kept.append(later)
        # Every 0.2 s, until the connection closes: six stripes of 2 MiB
        # a second on the three lanes that move (lane 0's wait behind its
        # stalled one).
        def keep_sending():
            while not stop.wait(0.2) and w.server.close_reason() == "":
                try:
                    w.client.send(b"later", [(ctypes.addressof(later), 8 * MB, 0, 0, 0)])
                except RuntimeError:  # "connection closed": the server's close came
                    return

        sender = threading.Thread(target=keep_sending, daemon=True)
        sender.start()
        stalled_segment_named(w, "4.0 s", "twice heartbeat_timeout")
        # The later segments did reach the server's lanes ahead of their
        # records (the client's lanes counted them as sent).
        assert lanes(w.client)["segments"] > 3, lanes(w.client)
    finally:
        stop.set()
        if sender is not None:
            sender.join(10)
        for sock in held:
            sock.close()
        w.close()


def test_a_stall_on_a_host_whose_cpus_are_saturated_is_given_two_more_timeouts(cpu_pressure):
    """A lane's silence while this host's CPUs are saturated (pressure
    stall information at or above 50%) may be its sender's starved
    thread, not a stalled path: as the heartbeat does for a silent peer,
    the stall check gives it two more heartbeat_timeouts before closing
    (still under the heartbeat's six). The pressure is the test's
    (_testing.set_cpu_pressure); before, the check closed after two
    timeouts whatever the host's load."""
    cpu_pressure(90.0)
    handle, held = stall_lane_zero()
    w = Wired(handle, heartbeat_timeout=2.0)
    try:
        payload = w.send_big(8 * MB)
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        w.send_big(64 * MB)
        stalled_segment_named(
            w, "8.0 s",
            "twice heartbeat_timeout, and two more: this host's CPUs were saturated, "
            "90% pressure")
    finally:
        for sock in held:
            sock.close()
        w.close()


def test_a_stripe_whose_pages_come_in_slowly_keeps_its_lane_alive(cpu_pressure):
    """A CPU tensor whose memory must be read in first (a memory-mapped
    file on slow storage, swap): here pages that the test's userfaultfd
    gives 4 s after they are first asked for, with heartbeat_timeout 1 s
    (a stall after 2 s of silence). The lanes read the pages in on threads
    of their own and send keepalives meanwhile, so the frame arrives whole.
    Before, each lane's own read of its stripe's first page held it,
    silent, and the receiver closed the connection as a stalled lane."""
    w = Wired(lambda d, u, i: (pass_hello(d, u, take_hello(d, u)), splice(d, u)),
              heartbeat_timeout=1.0)
    slow = SlowPages(8 * MB, delay=4.0)
    try:
        payload = w.send_big(8 * MB)  # dials the lanes; rides the stream
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        sent = time.monotonic()
        w.client.send(b"slow", [(slow.address, 8 * MB, 0, 0, 0)])
        got = w.received(30)
        assert got is not None, w.server.close_reason()
        assert got == (b"slow", [slow.expected])
        # The pages were asked for at once and came 4 s later: keepalives
        # held the lanes meanwhile (every 500 ms, on each of four lanes).
        assert slow.asked_at is not None and slow.asked_at - sent < 2.0
        assert lanes(w.client)["keepalives"] >= 8, lanes(w.client)
        assert lanes(w.server)["stalls"] == 0
    finally:
        w.close()
        slow.close()


def test_an_endpoint_closed_with_stripes_queued_on_its_lanes_sends_them_first():
    """The test harness's Endpoint.close(drain) waits for the frames it
    queued to be written: that includes the stripes its lanes still hold
    (a segment's record goes in the stream at once, its stripes on the
    lanes' threads). Before, the drain looked at the stream only, and the
    close cut the lanes under the stripes: the server lost the frame.
    Then the receiver's side: the client shuts its lanes one after another
    once written, so one of them ends (between chunks) while another still
    carries its share. That lane's reader now waits while lanes still open
    bring bytes; before, it closed the connection at once ("the peer
    closed lane 0 with a segment not all in"), which failed this test with
    the drain mended."""
    w = Wired(lambda d, u, i: (pass_hello(d, u, take_hello(d, u)), splice(d, u)))
    try:
        payload = w.send_big(8 * MB)
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        payload = w.send_big(64 * MB)
        w.client.close(30)
        assert w.received() == (b"big", [payload])
        assert lanes(w.client)["segments"] == 1, lanes(w.client)
    finally:
        w.close()


def send_a_stuck_stripe(w):
    """With TORCH_RPC_EXT_TEST_LANES_STUCK_COPY: a first large message
    (it dials the lanes and rides the stream), then one whose first stripe's
    copy never ends."""
    payload = w.send_big(8 * MB)
    assert w.received() == (b"big", [payload])
    w.lanes_up()
    w.send_big(8 * MB)


def test_a_stripe_whose_device_copy_never_ends_fails_after_six_heartbeat_timeouts(monkeypatch):
    """A lane whose stripe waits for a device copy sends keepalives, not
    bytes (TORCH_RPC_EXT_TEST_LANES_STUCK_COPY: its first stripe's copy never
    ends). The keepalives hold the receiver's record, and the heartbeat,
    for six heartbeat_timeouts at most; then the connection closes naming
    the device copy. Without that bound the frame, and every one behind
    it, would wait for ever."""
    monkeypatch.setenv("TORCH_RPC_EXT_TEST_LANES_STUCK_COPY", "1")
    w = Wired(lambda d, u, i: (pass_hello(d, u, take_hello(d, u)), splice(d, u)),
              heartbeat_timeout=1.0)
    try:
        send_a_stuck_stripe(w)
        assert w.server.receive(60) is None
        reason = w.server.close_reason()
        assert reason.startswith("tcp_lanes: segment 1 (8388608 bytes, 6291456 in) waited"), reason
        assert ("; for 6.0 s (six heartbeat_timeout) the peer's lanes said only that its "
                "bytes were on their way to them (keepalives): a copy out of a device, or a "
                "read of memory-mapped pages, that does not end") in reason, reason
        # One each 0.5 s held the record for the 6 s: 12 on an idle host, and
        # fewer where the sleeps between them overran; one each 2 s at least
        # (lanes_watch.cpp's quiet: twice the heartbeat_timeout), or the lane
        # would have been called silent first.
        assert lanes(w.client)["keepalives"] >= 3 and lanes(w.server)["stalls"] == 1
    finally:
        w.close()


def test_a_sender_whose_stripe_waits_on_a_device_copy_keeps_its_connection(monkeypatch):
    """As above, with the default tick (heartbeat_timeout / 5) longer than
    the keepalives' 0.5 s: the receiver, holding the record, hears from
    the lane and reads nothing of the stream, so it never pinged, and the
    sender, which hears nothing while it waits, closed the connection after
    one heartbeat_timeout ("no sign of life from the peer"; found by a
    helper's reading in session 94). The receiver pings each tick while it
    holds a record: after two timeouts both ends are still open."""
    monkeypatch.setenv("TORCH_RPC_EXT_TEST_LANES_STUCK_COPY", "1")
    w = Wired(lambda d, u, i: (pass_hello(d, u, take_hello(d, u)), splice(d, u)),
              heartbeat_timeout=3.0)
    try:
        send_a_stuck_stripe(w)
        assert w.server.receive(7) is None  # two timeouts, the copy stuck
        assert (w.client.close_reason(), w.server.close_reason()) == ("", "")
        assert lanes(w.client)["keepalives"] >= 3
    finally:
        w.close()


def test_frames_sent_ahead_of_a_segment_whose_lane_broke_are_delivered_first():
    """The stream lags the lanes (here its relay holds what the client sends;
    a busy loop or another network path does the same): the client sends a
    small frame, then a large one striped, and one lane is reset in the
    middle of its stripe before the server has read either. The small frame
    is delivered, and the connection is lost when the large one's record
    comes, naming the lane. Before, the lane's reset closed the connection
    at once, and the small frame, complete in the stream, was lost."""
    flowing = threading.Event()
    flowing.set()
    reset = threading.Event()
    kept = []

    def handle(dialler, upstream, index):
        pass_hello(dialler, upstream, take_hello(dialler, upstream))
        if index != 0:
            return splice(dialler, upstream)
        # Each side's first lane, relayed by this thread alone (a socket
        # another thread waits in recv() on is not reset by its close): once
        # the stream is held, part of the next stripe goes on, then the
        # server's end is reset, as a middlebox (or a peer that died) does.
        # Only the client's lanes carry anything.
        with selectors.DefaultSelector() as sel:
            sel.register(dialler, selectors.EVENT_READ, upstream)
            sel.register(upstream, selectors.EVENT_READ, dialler)
            while not reset.is_set():
                for key, _ in sel.select(timeout=0.05):
                    try:
                        data = key.fileobj.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    if key.fileobj is dialler and not flowing.is_set() and not reset.is_set():
                        upstream.sendall(data[:4096])
                        delivered(upstream)
                        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                            struct.pack("ii", 1, 0))
                        upstream.close()
                        reset.set()
                        break
                    key.data.sendall(data)
        # The client's end stays open, what it still sends read and dropped:
        # the break is the server's alone (a reset here would fail the
        # client's lane, and with it the client's connection).
        kept.append(dialler)
        with contextlib.suppress(OSError):
            while dialler.recv(1 << 20):
                pass

    def held_back(offset, data):
        flowing.wait(60)
        return data

    w = Wired(handle, relay_handler=lambda d, u, i: splice(d, u, held_back))
    try:
        payload = w.send_big(8 * MB)  # dials the lanes; rides the stream
        assert w.received() == (b"big", [payload])
        w.lanes_up()
        flowing.clear()  # from now on the stream's bytes wait in the relay
        w.client.send(b"small", [])
        w.send_big(8 * MB)
        wait_for("the server seeing its lane broken", lambda: lanes(w.server)["lanes_broken"] >= 1)
        time.sleep(0.2)  # (before, the connection was closed by now)
        flowing.set()
        assert w.received(15) == (b"small", []), w.server.close_reason()
        assert w.server.receive(15) is None
        reason = w.server.close_reason()
        assert re.fullmatch(r"tcp_lanes: the peer closed lane \d with a segment not all in "
                            r"\(segment 1's record came with \d+ of 8388608 bytes in\)", reason), reason
        assert lanes(w.server)["lanes_broken"] == 1, lanes(w.server)
    finally:
        flowing.set()
        w.close()
        for sock in kept:
            sock.close()
