# SPDX-License-Identifier: BSD-3-Clause
"""TLS on the wire, between two transport endpoints of one process (the
test hook torch_rpc_ext._testing.Endpoint: a tcp connection with no agent
above it) with a relay of ours in the middle that can alter or inject
bytes: a record altered or injected after the handshake fails TLS's
integrity check and closes that connection, and only it (the endpoint goes
on accepting); a peer keyed from another secret never gets past the TLS
handshake; bad certificate files are refused when the transport is made,
naming the file."""

import os
import re
import shutil
import socket
import threading
import time

import pytest

from tests.rpc.test_tls import _make_ca, _make_cert

_testing = pytest.importorskip("torch_rpc_ext._testing")

pytestmark = pytest.mark.timeout(120)

SECRET = "s" * 32


def endpoint(self_id, secret=SECRET, **kwargs):
    return _testing.Endpoint(self_id, 2, secret, "tcp", [], **kwargs)


def pump(src, dst, transform):
    """Copies `src` to `dst` through `transform(offset, data)` (`offset`: the
    bytes that went before) until either end stops; then shuts both."""
    offset = 0
    try:
        while data := src.recv(65536):
            out = transform(offset, data)
            offset += len(data)
            dst.sendall(out)
    except OSError:  # ssl.SSLError too
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Relay:
    """Forwards one connection to `target`. `mangle(direction, offset,
    data)` may rewrite each chunk ("up": client to server) before it goes
    on; `offset` is how many bytes of that direction went before it."""

    def __init__(self, target: str, mangle=None):
        host, port = target.rsplit(":", 1)
        self.target = (host.strip("[]"), int(port))
        self.mangle = mangle or (lambda direction, offset, data: data)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.threads = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        server = socket.create_connection(self.target)
        for src, dst, direction in ((client, server, "up"), (server, client, "down")):
            t = threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, src, dst, direction):
        pump(src, dst, lambda offset, data: self.mangle(direction, offset, data))

    def close(self):
        # shutdown() wakes an accept() still blocked in _accept's thread
        # (close() alone would leave it holding the socket, listening).
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()


def connect_through(relay_mangle, **kwargs):
    """A server endpoint, and a client connected to it through a relay."""
    server = endpoint(0, **kwargs)
    relay = Relay(server.address, relay_mangle)
    client = endpoint(1, **kwargs)
    client.connect(relay.address, 0)
    return server, client, relay


def flip_after(start: int):
    """Flips one bit of the client's bytes at offset `start` and later."""
    done = []

    def mangle(direction, offset, data):
        if direction != "up" or done or offset + len(data) <= start:
            return data
        i = max(0, start - offset)
        done.append(True)
        return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]

    return mangle


def test_an_altered_record_closes_that_connection_and_only_it():
    # Past the handshakes (a few KiB), in the middle of a 1 MiB frame.
    server, client, relay = connect_through(flip_after(300_000), encryption="always")
    try:
        assert client.wait_ready(30)
        assert client.security().startswith("TLSv1.3 TLS_AES_128_GCM_SHA256"), client.security()
        payload = bytes(range(256)) * 4096
        client.send(b"first", [])
        assert server.receive(30) == (b"first", [])
        client.send(b"big", [(memoryview_address(payload), len(payload), 0, 0, 0)])
        # The frame never arrives altered: the connection closes instead.
        assert server.receive(30) is None
        reason = server.close_reason()
        assert "a TLS record failed its integrity check" in reason, reason
        # The endpoint lives on: a new connection (no relay) works.
        other = endpoint(1, encryption="always")
        other.connect(server.address, 0)
        assert other.wait_ready(30)
        other.send(b"after", [])
        # (receive() answers None at once until the server's end of the new
        # connection is ready: the old one's close reason stands till then.)
        deadline = time.monotonic() + 30
        while (got := server.receive(1)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == (b"after", [])
        other.close(0)
    finally:
        relay.close()
        client.close(0)
        server.close(0)


def test_injected_bytes_close_the_connection():
    injected = []

    def inject(direction, offset, data):
        # After the handshakes: a forged record (application data, right
        # length, garbage where the ciphertext and tag belong).
        if direction == "up" and offset > 4096 and not injected:
            injected.append(True)
            return bytes([0x17, 0x03, 0x03, 0x00, 0x40]) + b"\x00" * 0x40 + data
        return data

    server, client, relay = connect_through(inject, encryption="always")
    try:
        assert client.wait_ready(30)
        client.send(b"first", [])
        assert server.receive(30) == (b"first", [])
        payload = b"x" * 200_000
        client.send(b"big", [(memoryview_address(payload), len(payload), 0, 0, 0)])
        assert server.receive(30) is None
        assert "a TLS record failed its integrity check" in server.close_reason()
    finally:
        relay.close()
        client.close(0)
        server.close(0)


# The server's answer in the key exchange before TLS (docs/wire-format.md,
# "Key exchange"): the bytes it sends before its first TLS record.
ANSWER_BYTES = 36


def flip_in_down_record(n):
    """Flips a byte in the body of the `n`th TLS record (from 0) the server
    sends, wherever the relay's chunks cut the stream."""
    stream = bytearray()
    done = []

    def mangle(direction, offset, data):
        if direction != "down" or done:
            return data
        stream.extend(data)
        start, index = ANSWER_BYTES, 0
        while start + 5 <= len(stream) and index < n:
            start += 5 + int.from_bytes(stream[start + 3:start + 5], "big")
            index += 1
        target = start + 5 + 8  # inside its body, past the 5-byte header
        if index < n or not offset <= target < offset + len(data):
            return data
        done.append(True)
        i = target - offset
        return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]

    return mangle


def test_an_altered_proof_of_the_servers_is_named_as_altered_not_as_a_refusal():
    # The server's records: its TLS flight (ServerHello, ChangeCipherSpec,
    # EncryptedExtensions, Finished), our challenge, then its proof (5).
    server, client, relay = connect_through(flip_in_down_record(5), encryption="always")
    try:
        assert not client.wait_ready(15)
        reason = client.close_reason()
        # Not "authentication failed: the peer closed the connection after
        # our proof": the peer closed nothing, a record of its was altered.
        assert reason.startswith("a TLS record failed its integrity check"), reason
    finally:
        relay.close()
        client.close(0)
        server.close(0)


def test_without_tls_the_same_alteration_goes_unseen():
    """What the test above guards against: in the clear, the altered byte
    reaches the receiver's tensor."""
    server, client, relay = connect_through(flip_after(300_000), encryption="off")
    try:
        assert client.wait_ready(30)
        assert client.security() == ""
        client.send(b"first", [])
        assert server.receive(30) == (b"first", [])
        payload = bytes(range(256)) * 4096
        client.send(b"big", [(memoryview_address(payload), len(payload), 0, 0, 0)])
        got = server.receive(30)
        assert got is not None and got[0] == b"big"
        assert got[1][0] != payload
    finally:
        relay.close()
        client.close(0)
        server.close(0)


def test_a_peer_keyed_from_another_secret_fails_the_tls_handshake():
    server = endpoint(0, encryption="always")
    client = endpoint(1, secret="t" * 32, encryption="always")
    try:
        client.connect(server.address, 0)
        assert not client.wait_ready(15)
        assert "TLS handshake" in client.close_reason(), client.close_reason()
        # Counted as failed (torch_rpc_ext_tls_handshakes_total{outcome=
        # "failed"}), none as done.
        counted = client.counters()["transport"]
        assert counted["tls_handshake_failures"] >= 1 and counted["tls_handshakes"] == 0
    finally:
        client.close(0)
        server.close(0)


@pytest.mark.parametrize("value", ["1000", "lots", str(1 << 41)])
def test_a_bad_key_update_volume_is_named_when_the_transport_is_made(monkeypatch, value):
    monkeypatch.setenv("TORCH_RPC_EXT_TLS_KEY_UPDATE_BYTES", value)
    with pytest.raises(RuntimeError, match="TORCH_RPC_EXT_TLS_KEY_UPDATE_BYTES=%s is not" % value):
        endpoint(0, encryption="always")
    endpoint(0, encryption="off").close(0)  # no TLS, nothing to key


def test_unusable_certificate_files_are_named_when_the_transport_is_made(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    _make_ca(tmp_path, "ca")
    cert, key = _make_cert(tmp_path, "ca", "w0")
    _, other_key = _make_cert(tmp_path, "ca", "w1")
    ca = str(tmp_path / "ca.pem")
    bad = tmp_path / "bad.pem"
    bad.write_text("not a PEM file\n")
    bad = str(bad)
    for files, text in [
        ([bad, key, ca], "cannot use tls_cert " + bad),
        ([cert, bad, ca], "cannot use tls_key " + bad),
        # (libssl compares a key with the certificate as it loads it)
        ([cert, other_key, ca], f"cannot use tls_key {other_key}: "),
        ([cert, key, bad], "cannot load tls_ca " + bad),
    ]:
        with pytest.raises(RuntimeError, match=re.escape(text)):
            endpoint(0, encryption="always", tls_files=files)
    # The good ones make a transport.
    endpoint(0, encryption="always", tls_files=[cert, key, ca]).close(0)


def memoryview_address(b: bytes) -> int:
    """The address of `b`'s bytes (kept alive by the caller)."""
    import ctypes

    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value


def test_a_server_that_shows_a_certificate_instead_of_using_the_key_is_refused(tmp_path):
    """A TLS 1.3 server may ignore the client's pre-shared key and
    authenticate with a certificate instead: one that is not one of ours
    (Python's ssl module here, with a self-signed certificate) must not get
    our frames, or even our hello."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    import ssl

    _make_ca(tmp_path, "impostor")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(tmp_path / "impostor.pem", tmp_path / "impostor.key")
    listener = socket.create_server(("127.0.0.1", 0))
    received = []

    def serve():
        conn, _ = listener.accept()
        try:
            # It answers the key exchange with a share of its own (any 32
            # bytes pass for one), then takes TLS.
            offer = b""
            while len(offer) < 52 and (chunk := conn.recv(52 - len(offer))):
                offer += chunk
            conn.sendall(b"CPc1" + os.urandom(32))
            with ctx.wrap_socket(conn, server_side=True) as tls:
                while data := tls.recv(65536):
                    received.append(data)
        except (ssl.SSLError, OSError):
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client = endpoint(1, encryption="always")
    try:
        client.connect("127.0.0.1:%d" % listener.getsockname()[1], 0)
        assert not client.wait_ready(15)
        reason = client.close_reason()
        assert "TLS handshake" in reason and "certificate verify failed" in reason, reason
        t.join(10)
        assert received == []
    finally:
        client.close(0)
        listener.close()


def test_a_relay_holding_a_certificate_from_the_ca_cannot_pass_the_handshake_on(tmp_path):
    """Mutual TLS, and an attacker with any certificate the group's CA
    signed: it terminates TLS with the client (as the server) and with the
    server (as a client) and forwards the bytes between the two sessions.
    TLS holds at both ends; our handshake's proofs cover each session's
    exporter value, so they fail and no frame of ours reaches the relay in
    the clear."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    import ssl

    _make_ca(tmp_path, "ca")
    ca = str(tmp_path / "ca.pem")
    files = {n: [*_make_cert(tmp_path, "ca", n), ca] for n in ("w0", "w1", "mallory")}
    server = endpoint(0, encryption="always", tls_files=files["w0"])
    mallory_cert, mallory_key, _ = files["mallory"]
    as_server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    as_server.minimum_version = ssl.TLSVersion.TLSv1_3
    as_server.load_cert_chain(mallory_cert, mallory_key)
    as_client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    as_client.minimum_version = ssl.TLSVersion.TLSv1_3
    as_client.check_hostname = False
    as_client.load_verify_locations(ca)
    as_client.load_cert_chain(mallory_cert, mallory_key)
    listener = socket.create_server(("127.0.0.1", 0))
    seen = {"up": b"", "down": b""}

    def recorded(direction):
        def transform(offset, data):
            seen[direction] += data
            return data

        return transform

    def relay():
        conn, _ = listener.accept()
        try:
            down = as_server.wrap_socket(conn, server_side=True)
            host, port = server.address.rsplit(":", 1)
            up = as_client.wrap_socket(socket.create_connection((host, int(port))))
        except (ssl.SSLError, OSError):
            return
        for src, dst, direction in ((down, up, "up"), (up, down, "down")):
            threading.Thread(target=pump, args=(src, dst, recorded(direction)),
                             daemon=True).start()

    threading.Thread(target=relay, daemon=True).start()
    client = endpoint(1, encryption="always", tls_files=files["w1"])
    try:
        client.connect("127.0.0.1:%d" % listener.getsockname()[1], 0)
        assert not client.wait_ready(15)
        reason = client.close_reason()
        assert "authentication failed: the peer closed the connection after our proof" in reason, reason
        # The server checked the client's proof (the client proves first)
        # against its own TLS session, the relay's, and refused it.
        deadline = time.monotonic() + 10
        while not server.close_reason() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "proof was made for another TLS session" in server.close_reason()
        # The relay saw the hello, the challenge and the client's proof (it
        # had to open TLS to relay them), and nothing more: no proof of the
        # server's, and no frame of the client's, which waits for that proof.
        time.sleep(0.5)
        assert len(seen["up"]) == 24 + 44 + 24 + 32, seen["up"]
        assert len(seen["down"]) == 24 + 44, seen["down"]
    finally:
        client.close(0)
        server.close(0)
        listener.close()
