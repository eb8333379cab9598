# SPDX-License-Identifier: BSD-3-Clause
"""What a recorded TLS connection gives a guesser of the group's secret.

TLS 1.3's PSK mode is no password-authenticated exchange: a ClientHello
carries its PSK binder in the clear, an HMAC under a key derived from the
PSK alone. Until session 105 every connection's PSK was HMAC(secret, label),
so one recorded ClientHello let a tap test guesses at a user's passphrase
offline. Now each connection's PSK comes from a CPace exchange before TLS
(csrc/common/cpace.h): the binder a tap records verifies under no key it can
compute from a guess, the right one included. Between two transport
endpoints of one process (torch_rpc_ext._testing.Endpoint) and a relay."""

import hashlib
import hmac
import os
import select
import shutil
import socket
import subprocess
import threading
import time

import pytest

from tests.rpc.test_tls_wire import SECRET, Relay, endpoint, pump
from torch_rpc_ext.testing import recv_exact

_testing = pytest.importorskip("torch_rpc_ext._testing")

pytestmark = pytest.mark.timeout(120)

PSK_LABEL = b"torch_rpc_ext/tls-psk/1"  # csrc/transport/tls.cpp, kPskLabel


def hkdf_expand_label(secret: bytes, label: bytes, context: bytes, length: int) -> bytes:
    """RFC 8446, section 7.1, over SHA-256 (the suites a PSK of ours uses)."""
    full = b"tls13 " + label
    info = length.to_bytes(2, "big") + bytes([len(full)]) + full + bytes([len(context)]) + context
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(secret, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def binder_holds(client_hello: bytes, psk: bytes) -> bool:
    """Whether the ClientHello's PSK binder (RFC 8446, 4.2.11.2; one
    external PSK, its binder the message's last 32 bytes) is the one `psk`
    makes: the offline guesser's test of a guess."""
    assert client_hello[-35:-32] == b"\x00\x21\x20", "one binder of 32 bytes"
    early = hmac.new(b"\0" * 32, psk, hashlib.sha256).digest()
    binder_key = hkdf_expand_label(early, b"ext binder", hashlib.sha256(b"").digest(), 32)
    finished = hkdf_expand_label(binder_key, b"finished", b"", 32)
    transcript = hashlib.sha256(client_hello[:-35]).digest()
    want = hmac.new(finished, transcript, hashlib.sha256).digest()
    return hmac.compare_digest(want, client_hello[-32:])


def client_hello_in(stream: bytes) -> bytes:
    """The ClientHello handshake message of the first TLS record in `stream`."""
    for i in range(len(stream) - 9):
        if stream[i:i + 3] == b"\x16\x03\x01" and stream[i + 5] == 0x01:
            length = int.from_bytes(stream[i + 3:i + 5], "big")
            message = stream[i + 5:i + 5 + length]
            assert int.from_bytes(message[1:4], "big") == len(message) - 4
            return message
    raise AssertionError("no ClientHello in %r" % stream[:80])


def test_the_binder_check_finds_the_key_of_an_openssl_client():
    """The check below can tell: a ClientHello of OpenSSL's own client,
    with a PSK we chose, verifies under that PSK and no other."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    listener = socket.create_server(("127.0.0.1", 0))
    got = []

    def record():
        conn, _ = listener.accept()
        conn.settimeout(10)
        data = b""
        try:
            while len(data) < 5 or len(data) < 5 + int.from_bytes(data[3:5], "big"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
        finally:
            conn.close()
            got.append(data)

    t = threading.Thread(target=record, daemon=True)
    t.start()
    psk = bytes(range(32))
    subprocess.run(
        ["openssl", "s_client", "-connect", "127.0.0.1:%d" % listener.getsockname()[1],
         "-tls1_3", "-ciphersuites", "TLS_AES_128_GCM_SHA256", "-psk", psk.hex()],
        stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    t.join(10)
    listener.close()
    hello = client_hello_in(got[0])
    assert binder_holds(hello, psk)
    assert not binder_holds(hello, bytes(32))


def test_a_recorded_tls_handshake_holds_nothing_to_test_a_guessed_secret_against():
    seen = {"up": b"", "down": b""}

    def record(direction, offset, data):
        seen[direction] += data
        return data

    server = endpoint(0, encryption="always")
    relay = Relay(server.address, record)
    client = endpoint(1, encryption="always")
    try:
        client.connect(relay.address, 0)
        assert client.wait_ready(30), client.close_reason()
        assert client.security().endswith("pre-shared key from the group secret (CPace)")
        client.send(b"first", [])
        assert server.receive(30) == (b"first", [])
        # The exchange in the clear: {tag, session id, share}, {tag, share}.
        assert seen["up"][:4] == b"CPc1" and seen["down"][:4] == b"CPc1"
        offer, answer = seen["up"][4:52], seen["down"][4:36]
        hello = client_hello_in(seen["up"][52:])
        # The guesser's test, with the right secret: the group's key, from
        # which every connection's PSK was until session 105, is not this
        # connection's; nor is the secret itself, nor the shares.
        group_key = hmac.new(SECRET.encode(), PSK_LABEL, hashlib.sha256).digest()
        for guess in (group_key, SECRET.encode(), offer[16:], answer):
            assert not binder_holds(hello, guess)
        # The shares are not the generator the right key makes for this
        # session: each is a fresh multiple of it.
        generator = _testing.cpace_generator(group_key, offer[:16])
        assert generator not in (offer[16:], answer)
    finally:
        relay.close()
        client.close(0)
        server.close(0)


PSK_TLS = ["-tls1_3", "-ciphersuites", "TLS_AES_128_GCM_SHA256",
           "-psk_identity", "torch_rpc_ext/1"]  # what our ends use (tls_peer.cpp)


def needs_openssl():
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")


def splice(a, b) -> list:
    """Copies bytes both ways between two sockets until either end stops;
    the two threads."""
    threads = [threading.Thread(target=pump, args=(src, dst, lambda offset, data: data),
                                daemon=True) for src, dst in ((a, b), (b, a))]
    for t in threads:
        t.start()
    return threads


def offer_under(sock, key: bytes) -> bytes:
    """The client's side of the key exchange before TLS (docs/
    wire-format.md, "Key exchange") over `sock`, under `key`: the PSK it
    gives this end, once the server's answer is in."""
    sock.settimeout(15)
    sid = os.urandom(16)
    mine = _testing.CpaceExchange(key, sid)
    sock.sendall(b"CPc1" + sid + mine.share)
    answer = recv_exact(sock, 36)
    assert answer[:4] == b"CPc1", answer
    return mine.finish(answer[4:], True)


def guessing_client(sock, key: bytes) -> str:
    """A guesser with a real TLS stack, over `sock` (connected to one of our
    servers): the key exchange under `key`, then OpenSSL's s_client under
    the PSK that gives its side. What s_client printed."""
    psk = offer_under(sock, key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(15)
    p = subprocess.Popen(
        ["openssl", "s_client", "-connect", "127.0.0.1:%d" % listener.getsockname()[1],
         "-psk", psk.hex(), *PSK_TLS],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    conn, threads = None, []
    try:
        conn, _ = listener.accept()
        threads = splice(conn, sock)
        return p.communicate(timeout=30)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        listener.close()
        for t in threads:  # (pump shuts both sockets as it ends)
            t.join(15)
        if conn is not None:
            conn.close()


@pytest.mark.parametrize("right", [False, True], ids=["guessed", "right"])
def test_a_guessing_client_fails_the_tls_handshake_and_is_counted(right):
    """A client that runs the exchange under a guessed key offers a binder
    the server refuses: the guess costs a connection, counted (and struck
    against its source: test_source_holdoff.py). With the right key the
    same client gets through TLS (what makes the check worth something)."""
    needs_openssl()
    server = endpoint(0, encryption="always")
    try:
        group_key = hmac.new(SECRET.encode(), PSK_LABEL, hashlib.sha256).digest()
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            printed = guessing_client(sock, group_key if right else b"g" * 32)
        counted = server.counters()["transport"]
        if right:
            assert "Cipher is TLS_AES_128_GCM_SHA256" in printed, printed
            return
        assert "Cipher is (NONE)" in printed, printed
        reason = wait_for_reason(server, "TLS handshake")
        assert "TLS handshake" in reason, reason
        deadline = time.monotonic() + 10
        while counted["tls_handshake_failures"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            counted = server.counters()["transport"]
        assert counted["tls_handshake_failures"] == 1 and counted["tls_handshakes"] == 0
    finally:
        server.close(0)


@pytest.mark.parametrize("right", [False, True], ids=["guessed", "right"])
def test_an_impostor_server_learns_only_whether_its_one_guess_was_right(right):
    """A listener a client was sent to, which answers the exchange under a
    guessed key and then runs a real TLS server (OpenSSL's s_server) under
    the PSK its side derives: with a wrong guess the client's TLS handshake
    fails and it sends nothing more; with the right key (the control) TLS
    comes up and the client's hello reaches it."""
    needs_openssl()
    group_key = hmac.new(SECRET.encode(), PSK_LABEL, hashlib.sha256).digest()
    key = group_key if right else b"g" * 32
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)
    servers, sockets, errors = [], [], []

    def impostor():
        try:
            conn, _ = listener.accept()
            sockets.append(conn)
            conn.settimeout(15)
            offer = recv_exact(conn, 52)
            mine = _testing.CpaceExchange(key, offer[4:20])
            conn.sendall(b"CPc1" + mine.share)
            psk = mine.finish(offer[20:], False)
            with socket.create_server(("127.0.0.1", 0)) as probe:
                port = probe.getsockname()[1]  # free now; s_server takes it
            servers.append(subprocess.Popen(
                ["openssl", "s_server", "-accept", "127.0.0.1:%d" % port, "-naccept", "1",
                 "-nocert", "-quiet", "-psk", psk.hex(), *PSK_TLS],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            deadline = time.monotonic() + 10
            while True:
                try:
                    behind = socket.create_connection(("127.0.0.1", port), timeout=10)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            sockets.append(behind)
            splice(conn, behind)
        except Exception as e:  # noqa: BLE001 (said by the test, not lost in a thread)
            errors.append(repr(e))

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    client = endpoint(1, encryption="always")
    first = b""
    try:
        client.connect("127.0.0.1:%d" % listener.getsockname()[1], 0)
        if right:
            # The hello goes out inside TLS (no challenge ever comes back):
            # its first bytes on s_server's output.
            thread.join(20)
            assert servers and not errors, errors
            deadline = time.monotonic() + 20
            while len(first) < 4 and time.monotonic() < deadline:
                ready, _, _ = select.select([servers[0].stdout], [], [], 0.5)
                if ready:
                    chunk = os.read(servers[0].stdout.fileno(), 4 - len(first))
                    if not chunk:
                        break
                    first += chunk
        else:
            assert not client.wait_ready(15)
            reason = client.close_reason()
            assert "TLS handshake" in reason and "alert" in reason, reason
    finally:
        client.close(0)
        thread.join(20)
        listener.close()
        out = err = b""
        for p in servers:
            try:
                out, err = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
        for sock in sockets:
            sock.close()
    assert servers and not errors, errors
    if right:
        assert first == b"TRPX", (first, out, err)  # our hello's frame header
    else:
        assert b"binder does not verify" in err and out == b"", (out, err)


def raw_client(address: str, first: bytes) -> bytes:
    """Sends `first` to `address` and returns what comes back until the
    server closes (or 10 s pass)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as s:
        s.sendall(first)
        back = b""
        try:
            while chunk := s.recv(4096):
                back += chunk
        except OSError:
            pass
        return back


def wait_for_reason(server, needle: str) -> str:
    deadline = time.monotonic() + 10
    while needle not in server.close_reason() and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.close_reason()


@pytest.mark.parametrize("first, reason", [
    # A client that begins TLS without the exchange (one using
    # certificates, or an older torch_rpc_ext).
    (bytes.fromhex("160301002c01000028") + b"\0" * 40, "began TLS without the key exchange"),
    # An offer whose tag is wrong past its first byte.
    (b"CPx1" + b"\0" * 48, "does not begin with its tag"),
    # A share of small order: X25519 gives all zeros.
    (b"CPc1" + b"\1" * 16 + b"\0" * 32, "key exchange: X25519"),
])
def test_a_server_names_what_is_wrong_with_a_clients_start_and_goes_on(first, reason):
    server = endpoint(0, encryption="always")
    try:
        raw_client(server.address, first)
        assert reason in wait_for_reason(server, reason)
        # It goes on: an honest client connects.
        client = endpoint(1, encryption="always")
        client.connect(server.address, 0)
        assert client.wait_ready(30), client.close_reason()
        client.close(0)
    finally:
        server.close(0)


def test_an_end_in_the_clear_names_a_peer_that_begins_the_key_exchange():
    server = endpoint(0, encryption="off")
    client = endpoint(1, encryption="always")
    try:
        client.connect(server.address, 0)
        assert not client.wait_ready(15)
        assert "does the peer have encryption off?" in client.close_reason()
        reason = wait_for_reason(server, "began a TLS handshake")
        assert "the peer began a TLS handshake: it encrypts this connection and this end does not" in reason, reason
    finally:
        client.close(0)
        server.close(0)


def test_ends_that_key_tls_differently_name_it(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    from tests.rpc.test_tls import _make_ca, _make_cert

    _make_ca(tmp_path, "ca")
    files = [*_make_cert(tmp_path, "ca", "w0"), str(tmp_path / "ca.pem")]
    for server_files, client_files, reason in (
            (files, None, "the peer keys TLS from the group secret and this end uses certificates"),
            (None, files, "the peer began TLS without the key exchange")):
        server = endpoint(0, encryption="always", **({"tls_files": server_files} if server_files else {}))
        client = endpoint(1, encryption="always", **({"tls_files": client_files} if client_files else {}))
        try:
            client.connect(server.address, 0)
            assert not client.wait_ready(15)
            assert reason in wait_for_reason(server, reason)
        finally:
            client.close(0)
            server.close(0)


def accepted(listener, stop):
    """The connections `listener` takes until `stop` is set or it closes."""
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        except OSError:
            return
        yield conn


def test_a_server_that_keeps_ending_tls_unfinished_is_held_off():
    """An impostor a client was sent to learns, from each connection the
    client makes to it, whether one guess at the secret was right: it
    answers the key exchange under its guess and reads the binder of the
    ClientHello that follows. The client counts those connections against
    the address (TLS unfinished after the exchange, however it ended): 8
    within 10 s and it stops dialing that address for 30 s, saying why, so
    the impostor gets 8 guesses where it had one per dial (before: all 12
    dials reached it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    hellos, errors, stop = [], [], threading.Event()

    def impostor():
        for conn in accepted(listener, stop):
            with conn:
                try:
                    conn.settimeout(10)
                    offer = recv_exact(conn, 52)
                    guess = _testing.CpaceExchange(b"g" * 32, offer[4:20])
                    conn.sendall(b"CPc1" + guess.share)
                    header = recv_exact(conn, 5)  # the ClientHello's record
                    assert header[0] == 0x16, header
                    hellos.append(recv_exact(conn, int.from_bytes(header[3:5], "big")))
                except Exception as e:  # noqa: BLE001 (said by the test)
                    errors.append(repr(e))

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    client = endpoint(1, encryption="always")
    reasons = []
    try:
        for _ in range(12):
            client.connect(address, 0)
            assert not client.wait_ready(15)
            reasons.append(client.close_reason())
        counted = client.counters()["transport"]
    finally:
        client.close(0)
        stop.set()
        thread.join(15)
        listener.close()
    assert not errors, errors
    assert len(hellos) == 8, (len(hellos), reasons)
    for reason in reasons[:8]:
        assert "TLS handshake" in reason and "peer closed" in reason, reason
    for reason in reasons[8:]:
        assert reason.startswith("connect to %s refused here: its server ended 8 of our TLS "
                                 "handshakes unfinished after the key exchange within 10 s; "
                                 "held off for 30 s" % address), reason
    assert counted["servers_held_off"] == 1 and counted["dials_held_off"] == 4, counted


def test_a_server_that_proves_itself_is_never_held_off():
    """The control: ten dials to a worker holding the secret, each TLS
    handshake finished, then each connection ended by the frame handshake
    (the dial expected another worker id): nothing counts against it, and
    the next dial gets through."""
    server = endpoint(0, encryption="always")
    client = endpoint(1, encryption="always")
    try:
        for _ in range(10):
            client.connect(server.address, 5)
            assert not client.wait_ready(15)
            assert "expected worker id 5 but the peer is worker id 0" in client.close_reason()
        counted = client.counters()["transport"]
        assert counted["tls_handshakes"] == 10 and counted["tls_handshake_failures"] == 0, counted
        assert counted["servers_held_off"] == 0 and counted["dials_held_off"] == 0, counted
        client.connect(server.address, 0)
        assert client.wait_ready(15), client.close_reason()
    finally:
        client.close(0)
        server.close(0)


def test_a_dial_under_way_as_the_hold_off_begins_sends_no_binder():
    """Seven dials struck, then two at once: the impostor keeps the first's
    answer back until the second has ended unfinished (the eighth strike),
    then answers it. The held dial closes before its ClientHello (the
    impostor reads the end of its stream), saying it is refused."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    hellos, held_saw, errors, stop = [], [], [], threading.Event()
    eighth_struck, threads = threading.Event(), []

    def answer(conn, hold):
        with conn:
            try:
                conn.settimeout(15)
                offer = recv_exact(conn, 52)
                if hold and not eighth_struck.wait(15):
                    raise AssertionError("the other dial never ended")
                guess = _testing.CpaceExchange(b"g" * 32, offer[4:20])
                conn.sendall(b"CPc1" + guess.share)
                if hold:
                    held_saw.append(conn.recv(5))
                    return
                header = recv_exact(conn, 5)
                hellos.append(recv_exact(conn, int.from_bytes(header[3:5], "big")))
            except Exception as e:  # noqa: BLE001 (said by the test)
                errors.append(repr(e))

    def impostor():
        for count, conn in enumerate(accepted(listener, stop), 1):
            t = threading.Thread(target=answer, args=(conn, count == 8), daemon=True)
            t.start()
            threads.append(t)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    client = endpoint(1, encryption="always")
    try:
        for _ in range(7):
            client.connect(address, 0)
            assert not client.wait_ready(15)
        client.connect(address, 0)  # held at its answer
        deadline = time.monotonic() + 15
        while len(threads) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        client.connect(address, 0)  # the eighth to end unfinished
        assert not client.wait_ready(15)
        assert client.counters()["transport"]["servers_held_off"] == 1
        eighth_struck.set()
        deadline = time.monotonic() + 15
        while "refused here" not in client.close_reason() and time.monotonic() < deadline:
            time.sleep(0.01)
        reason = client.close_reason()
        counted = client.counters()["transport"]
    finally:
        eighth_struck.set()
        client.close(0)
        stop.set()
        thread.join(15)
        for t in threads:
            t.join(15)
        listener.close()
    assert not errors, errors
    assert len(hellos) == 8 and held_saw == [b""], (len(hellos), held_saw)
    assert "refused here: its server ended 8 of our TLS handshakes" in reason, reason
    assert counted["servers_held_off"] == 1 and counted["dials_held_off"] == 1, counted
