# SPDX-License-Identifier: BSD-3-Clause
"""A source address whose proofs the main listener refuses 8 times within
10 s is held off for 30 s: its next connections are closed unread, so an
online guesser pays with its address (docs/security.md, "online guesser").
Only a refused proof counts (a wrong secret, a failed TLS handshake), not
garbage, knocks or silence; a neighbour's address is not held off. Between
transport endpoints of one process (torch_rpc_ext._testing.Endpoint), the
prober speaking from 127.0.0.3 and the neighbour from 127.0.0.4."""

import shutil
import socket
import struct
import time

import pytest

from torch_rpc_ext.testing import (
    PROOF,
    _proof,
    closed_by_peer,
    connect_raw,
    frame_header,
    handshake,
    hello_and_challenge,
    recv_exact,
)

_testing = pytest.importorskip("torch_rpc_ext._testing")

pytestmark = pytest.mark.timeout(120)

SECRET = "s" * 32
PROBER = "127.0.0.3"
NEIGHBOUR = "127.0.0.4"
FAILURES = 8  # SourceStrikes' default limit


def endpoint(self_id, **kwargs):
    return _testing.Endpoint(self_id, 2, SECRET, "tcp", [], **kwargs)


def held_off(server):
    c = server.counters()["transport"]
    return c["sources_held_off"], c["connections_held_off"]


def answered_with_a_challenge(address, source):
    """Whether the listener answers a hello from `source` (a held-off
    source's connection is closed unread)."""
    sock = connect_raw(address, source=source)
    try:
        hello_and_challenge(sock)
        return True
    except (ConnectionError, OSError):
        return False
    finally:
        sock.close()


def challenged(address):
    """A connection from the prober that has its challenge, its proof not
    yet sent: (socket, what the proof covers)."""
    sock = connect_raw(address, source=PROBER)
    return sock, hello_and_challenge(sock)


def proof_answered(sock, challenge):
    """Sends the right proof on a challenged connection: whether the
    listener answered with its own (False: closed unchecked)."""
    cn, sid, sinc, sn = challenge
    try:
        sock.sendall(frame_header(PROOF, 32) + _proof(SECRET.encode(), b"client", cn, sn, 0, sid, 0, sinc))
        return struct.unpack("<IBBHIIQ", recv_exact(sock, 24))[2] == PROOF
    except (ConnectionError, OSError):
        return False
    finally:
        sock.close()


def until(predicate, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def refused_proof(address, source=PROBER):
    sock, ok = handshake(address, b"not-the-secret-at-all-0123456789", stretch=False, source=source)
    sock.close()
    return not ok


def test_a_source_whose_proofs_are_refused_is_held_off_and_only_it():
    server = endpoint(0)
    client = endpoint(1)
    try:
        address = server.address
        # Garbage, knocks and a hello left unproven prove nothing wrong:
        # never a strike (a port scanner does not lock a host out).
        for data in (b"GET / HTTP/1.0\r\n\r\n", b"", b"\x00" * 64):
            s = connect_raw(address, source=PROBER)
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(10)
            assert closed_by_peer(s)
            s.close()
        # Connections opened before the hold-off, to prove on afterwards.
        early = [challenged(address) for _ in range(2)]
        for _ in range(FAILURES - 1):
            assert refused_proof(address)
        assert held_off(server) == (0, 0)
        assert answered_with_a_challenge(address, PROBER)
        assert proof_answered(*early.pop())  # the right proof, not yet held off
        # The eighth refused proof within 10 s holds the source off.
        assert refused_proof(address)
        assert held_off(server)[0] == 1
        # A connection opened before is closed at its proof, unchecked (or a
        # guesser would open many first and prove on each afterwards).
        assert not proof_answered(*early.pop())
        assert held_off(server) == (1, 1)
        # Its next connection is closed unread, the right secret or not...
        assert not answered_with_a_challenge(address, PROBER)
        sock = connect_raw(address, source=PROBER)
        sock.settimeout(10)
        assert closed_by_peer(sock)
        sock.close()
        assert held_off(server) == (1, 3)
        # ...while a neighbour's address and the real peer are served.
        sock, ok = handshake(address, SECRET.encode(), stretch=False, source=NEIGHBOUR)
        sock.close()
        assert ok
        client.connect(address, 0)
        assert client.wait_ready(15), client.close_reason()
        assert held_off(server) == (1, 3)
    finally:
        client.close(0)
        server.close(0)


def test_an_exempt_source_is_never_held_off_and_only_it():
    # hold_off_exempt: where peers share an address (a NAT), a worker with
    # the wrong secret must not hold its neighbours off.
    server = endpoint(0, hold_off_exempt=["127.0.0.2/31"])  # .2 and .3: the prober's
    try:
        address = server.address
        for _ in range(FAILURES + 2):
            assert refused_proof(address)
        counters = server.counters()["transport"]
        assert held_off(server) == (0, 0), counters
        assert counters["hold_off_exempt_failures"] == FAILURES + 2, counters
        sock, ok = handshake(address, SECRET.encode(), stretch=False, source=PROBER)
        sock.close()
        assert ok
        # The neighbour, outside the network, is held off as before.
        for _ in range(FAILURES):
            assert refused_proof(address, NEIGHBOUR)
        assert held_off(server)[0] == 1
        assert not answered_with_a_challenge(address, NEIGHBOUR)
        assert answered_with_a_challenge(address, PROBER)
        assert held_off(server) == (1, 1)
        assert server.counters()["transport"]["hold_off_exempt_failures"] == FAILURES + 2
    finally:
        server.close(0)


def _exempt_through_init_rpc(rank, world_size):
    import os

    from torch.distributed import rpc

    from tests.rpc.world import init
    from torch_rpc_ext import metrics

    os.environ["TORCH_RPC_EXT_HOLD_OFF_EXEMPT"] = f"{PROBER}, 10.0.0.0/8"
    init(rank, world_size, secret=b"hold-off-exempt-secret-0123456789", transports=["tcp"])
    agent = rpc.api._get_current_rpc_agent()
    address = agent.get_debug_info()["rpc_ext.listen.tcp"]
    out = {"refused": [refused_proof(address) for _ in range(FAILURES + 1)]}
    out["prober_answered"] = answered_with_a_challenge(address, PROBER)
    for _ in range(FAILURES):
        refused_proof(address, NEIGHBOUR)
    out["neighbour_answered"] = answered_with_a_challenge(address, NEIGHBOUR)
    m = agent.get_metrics()
    out["metrics"] = {k: int(m[f"rpc_ext.tcp.{k}"]) for k in (
        "hold_off_exempt_failures", "sources_held_off", "connections_held_off")}
    try:
        out["exported"] = {
            fam.name: [s.value for s in fam.samples if s.labels.get("transport") == "tcp"]
            for fam in metrics.collector().collect() if fam.name.endswith(("held_off", "exempt_failures"))}
    except ImportError:  # (no prometheus_client)
        out["exported"] = None
    rpc.shutdown()
    return out


def test_the_exemption_reaches_the_listener_from_the_environment_through_init_rpc():
    from tests.rpc.world import run_world

    out = run_world(_exempt_through_init_rpc, world_size=1)[0]
    assert out["refused"] == [True] * (FAILURES + 1)
    assert out["prober_answered"] and not out["neighbour_answered"]
    assert out["metrics"] == {
        "hold_off_exempt_failures": FAILURES + 1, "sources_held_off": 1, "connections_held_off": 1}
    if out["exported"] is not None:
        assert out["exported"] == {
            "torch_rpc_ext_hold_off_exempt_failures": [FAILURES + 1],
            "torch_rpc_ext_sources_held_off": [1],
            "torch_rpc_ext_connections_held_off": [1],
            # (The other way, servers this worker stopped dialing: none.)
            "torch_rpc_ext_servers_held_off": [0],
            "torch_rpc_ext_dials_held_off": [0],
        }, out["exported"]


def exchanged(address, source):
    """A connection from `source` past the key exchange before TLS
    (docs/wire-format.md, "Key exchange"), run with a guessed key: the
    server's answer read, its PSK not ours."""
    from tests.rpc.test_tls_guessing import offer_under

    sock = connect_raw(address, source=source)
    offer_under(sock, b"guess" * 6 + b"!!")
    return sock


def failed_tls_handshake(address):
    """A guesser of a TLS-PSK group's key: the key exchange under a guessed
    key, then a real TLS client (OpenSSL's s_client) under the PSK that
    gives its side. Whether its handshake failed."""
    from tests.rpc.test_tls_guessing import guessing_client

    sock = connect_raw(address, source=PROBER)
    try:
        return "Cipher is (NONE)" in guessing_client(sock, b"g" * 32)
    finally:
        sock.close()


def test_failed_tls_handshakes_hold_their_source_off():
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command (a real TLS client to guess with)")
    server = endpoint(0, encryption="always")
    client = endpoint(1, encryption="always")
    try:
        address = server.address
        # Clients that go away mid-handshake refused nothing of ours: no
        # strike (a health check, a peer that exited).
        for _ in range(FAILURES + 2):
            s = exchanged(address, PROBER)
            s.sendall(b"\x16\x03\x01\x00\x40" + b"\x01" * 8)
            s.close()
        until(lambda: sum(server.counters()["transport"][k] for k in (
            "tls_handshake_failures", "connections_held_off")) >= FAILURES + 2,
            "the listener never saw the clients go")
        assert held_off(server) == (0, 0)
        for _ in range(FAILURES):
            assert failed_tls_handshake(address)
        # (The alert that failed the client goes before the listener counts.)
        until(lambda: held_off(server)[0] == 1, f"not held off: {server.counters()['transport']}")
        assert held_off(server) == (1, 0)
        # Closed unread: a connection from the prober sees its end at once,
        # one from the neighbour waits for its first byte.
        sock = connect_raw(address, source=PROBER)
        sock.settimeout(10)
        assert closed_by_peer(sock)
        sock.close()
        sock = connect_raw(address, source=NEIGHBOUR)
        sock.settimeout(1)
        assert not closed_by_peer(sock)
        sock.close()
        assert held_off(server) == (1, 1)
        client.connect(address, 0)
        assert client.wait_ready(15), client.close_reason()
    finally:
        client.close(0)
        server.close(0)


@pytest.mark.parametrize("offer, strikes", [
    # A share of small order (X25519 gives no secret): crafted, as no honest
    # client's is, after the server ran its side of the exchange.
    (b"CPc1" + b"s" * 16 + b"\0" * 32, True),
    # Not the exchange's tag past its first byte (an HTTP proxy's CONNECT
    # begins with the same letter): garbage, which never counts.
    (b"CPx1" + b"s" * 48, False),
], ids=["share", "tag"])
def test_a_crafted_key_exchange_share_holds_its_source_off_and_garbage_does_not(offer, strikes):
    server = endpoint(0, encryption="always")
    try:
        address = server.address
        for _ in range(FAILURES + (0 if strikes else 2)):
            sock = connect_raw(address, source=PROBER)
            sock.settimeout(10)
            sock.sendall(offer)
            assert closed_by_peer(sock)
            sock.close()
        if strikes:
            until(lambda: held_off(server)[0] == 1, f"not held off: {server.counters()['transport']}")
        # The neighbour's connection is read (not closed unread): only the
        # prober is held off, and only for a crafted share.
        sock = connect_raw(address, source=NEIGHBOUR)
        sock.settimeout(10)
        sock.sendall(offer)
        assert closed_by_peer(sock)
        sock.close()
        assert held_off(server) == ((1, 0) if strikes else (0, 0))
    finally:
        server.close(0)
