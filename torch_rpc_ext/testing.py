# SPDX-License-Identifier: BSD-3-Clause
"""Fault injection for tests: the FAULTY_TORCH_RPC_EXT backend.

Importing this module registers ``rpc.BackendType.FAULTY_TORCH_RPC_EXT``, the
counterpart of upstream's ``FAULTY_TENSORPIPE`` with the same knobs::

    import torch_rpc_ext.testing
    opts = torch_rpc_ext.testing.FaultyRpcExtBackendOptions(
        num_fail_sends=3,                       # fail the first 3 sends ...
        messages_to_fail=["RREF_FORK_REQUEST"], # ... of each message of these types
        messages_to_delay={"SCRIPT_CALL": 1.5}, # hold these back 1.5 s before writing
    )

A failed send's future carries an RPC error of type INTENTIONAL_FAILURE, so
upstream's retrying senders (RRef and dist-autograd control messages) retry
it. Delays do not block the caller: the message waits on the agent's pool
while its timeout runs. Only a call whose timeout ends before its message is
written (timeout <= delay) makes the caller wait, for the timeout: it is
returned already failed, as FAULTY_TENSORPIPE (which sleeps through every
delay in send()) returns it, which upstream's rpc.remote() to self relies on.
Everything else is the TORCH_RPC_EXT agent.

The second half is a raw client of the wire protocol (docs/wire-format.md) for
tests and fuzzing: frame headers, the client side of the handshake, and a
check that the agent closed a connection.
"""

import functools
import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.rpc import constants

from torch_rpc_ext import _C, _torch_private
from torch_rpc_ext.backend import _init_backend
from torch_rpc_ext.options import RpcExtBackendOptions

__all__ = [
    "FAULTY_BACKEND_NAME",
    "FaultyRpcExtBackendOptions",
    "register_faulty",
    "frame_header",
    "handshake",
    "connect_raw",
    "closed_by_peer",
]

FAULTY_BACKEND_NAME = "FAULTY_TORCH_RPC_EXT"


class FaultyRpcExtBackendOptions(RpcExtBackendOptions):
    """RpcExtBackendOptions plus fault injection (tests only).

    The knobs live in the core's options (``_C._RpcExtBackendOptionsBase``'s
    private fault fields), so they reach the agent with the rest.
    """

    def __init__(
        self,
        *,
        num_fail_sends: int = 0,
        messages_to_fail: Sequence[str] = (),
        messages_to_delay: Mapping[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(num_fail_sends, bool) or not isinstance(num_fail_sends, int) or num_fail_sends < 0:
            raise ValueError(f"num_fail_sends must be an int >= 0, got {num_fail_sends!r}")
        if not isinstance(messages_to_fail, str):
            messages_to_fail = list(messages_to_fail)  # (a generator is read once)
        if isinstance(messages_to_fail, str) or not all(
                isinstance(m, str) for m in messages_to_fail):
            raise ValueError(
                f"messages_to_fail must be a sequence of message type names, "
                f"got {messages_to_fail!r}")
        messages_to_delay = dict(messages_to_delay or {})
        for name, seconds in messages_to_delay.items():
            if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                    or not 0 <= seconds < float("inf")):
                raise ValueError(
                    f"messages_to_delay[{name!r}] must be a finite number >= 0 "
                    f"seconds, got {seconds!r}")
        super().__init__(**kwargs)
        self._num_fail_sends = num_fail_sends
        self._messages_to_fail = list(messages_to_fail)
        self._messages_to_delay = messages_to_delay

    @property
    def num_fail_sends(self) -> int:
        return self._num_fail_sends

    @property
    def messages_to_fail(self) -> list[str]:
        return self._messages_to_fail

    @property
    def messages_to_delay(self) -> dict[str, float]:
        return self._messages_to_delay


def _construct_options(
    rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = constants.DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> FaultyRpcExtBackendOptions:
    return FaultyRpcExtBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def register_faulty() -> Any:
    """Register FAULTY_TORCH_RPC_EXT (once) and return its ``BackendType`` member."""
    return _torch_private.register_backend(FAULTY_BACKEND_NAME, _construct_options, _init_backend)


FAULTY_BACKEND = register_faulty()


# ---- raw wire client -------------------------------------------------------

HELLO, CHALLENGE, PROOF, MESSAGE, PING, PONG, FRAME_RING = 1, 2, 3, 4, 5, 6, 7


def channel_frame_kind(channel: str, offset: int) -> int:
    """The kind of a channel's control frame number ``offset``: the registry
    gives the channel at position i of ``channel_names()`` its own kinds
    (docs/wire-format.md)."""
    position = list(_C.channel_names()).index(channel)
    return _C.FIRST_CHANNEL_FRAME_KIND + position * _C.FRAME_KINDS_PER_CHANNEL + offset


SLAB, SLAB_RELEASE, SLAB_DROP = (channel_frame_kind("shm_slab", k) for k in range(3))
RING, RING_DROP = (channel_frame_kind("shm_ring", k) for k in range(2))


def frame_header(kind, head_len, nseg=0, data=0, magic=None, version=None, flags=0):
    """The 24-byte frame header; any field can be forged."""
    return struct.pack(
        "<IBBHIIQ",
        _C.FRAME_MAGIC if magic is None else magic,
        _C.PROTOCOL_VERSION if version is None else version,
        kind, flags, head_len, nseg, data,
    )


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def closed_by_peer(sock: socket.socket) -> bool:
    """True if the peer closes the socket (EOF or reset) within its timeout."""
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def lingering_socket(linger_s: int = 60) -> tuple[socket.socket, socket.socket]:
    """A TCP socket whose last close() blocks for ``linger_s`` (set to
    linger, with more bytes queued than the other end, which never reads,
    has room for), and that other end: closing it, unread bytes and all,
    resets the first, and a close waiting on it returns."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client = socket.create_connection(server.getsockname())
    other, _ = server.accept()
    server.close()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger_s))
    client.setblocking(False)
    try:
        while True:
            client.send(b"x" * 65536)
    except BlockingIOError:
        pass
    return client, other


def connect_raw(address: str, timeout: float = 5, source: str | None = None) -> socket.socket:
    """A plain socket to an agent's "host:port" (tcp) or "@name" (shm)
    address; tcp from the local address ``source`` where given (any of
    127.0.0.0/8 on loopback: a second "host")."""
    if address.startswith("@"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect("\0" + address[1:])
        return sock
    host, port = address.rsplit(":", 1)
    return socket.create_connection(
        (host.strip("[]"), int(port)), timeout=timeout,
        source_address=(source, 0) if source else None)


def _proof(secret, role, cn, sn, cid, sid, cinc, sinc):
    msg = b"torch_rpc_ext/3/" + role + cn + sn + struct.pack("<iiQQ", cid, sid, cinc, sinc)
    return hmac.new(secret, msg, hashlib.sha256).digest()


@functools.lru_cache(maxsize=16)
def _stretched(secret: bytes) -> bytes:
    """secrets.stretch, once per secret: it is PBKDF2 at the agent's rounds
    (0.4 s of CPU here), and a test or fuzzer that opens hundreds of
    connections with one secret would spend most of its time there."""
    from torch_rpc_ext import secrets

    return secrets.stretch(secret)


def hello_and_challenge(sock: socket.socket, client_id: int = 0, incarnation: int = 0):
    """The handshake's first half on ``sock``: our hello as worker
    ``client_id`` of ``incarnation``, the agent's challenge. Returns (our
    nonce, the server's id, its incarnation, its nonce)."""
    cn = os.urandom(32)
    hello = struct.pack("<iQ", client_id, incarnation) + cn
    sock.sendall(frame_header(HELLO, len(hello)) + hello)
    hdr = recv_exact(sock, 24)
    if struct.unpack("<IBBHIIQ", hdr)[2] != CHALLENGE:
        raise ConnectionError("the agent did not answer with a challenge")
    body = recv_exact(sock, 44)
    sid, sinc = struct.unpack("<iQ", body[:12])
    return cn, sid, sinc, body[12:44]


def handshake(
    address: str,
    secret: bytes,
    client_id: int = 0,
    incarnation: int = 0,
    stretch: bool = True,
    source: str | None = None,
):
    """Run the client side of the handshake (docs/wire-format.md) as worker
    ``client_id`` of ``incarnation`` (0 in a static group); return (socket,
    server proof ok?): the client proves first, and a server that refuses
    the proof closes without one (False). ``secret`` is a user's, stretched as the agent
    stretches it (torch_rpc_ext/secrets.py), or with ``stretch=False`` the
    key itself (a secret the group made). ``source``: as connect_raw's."""
    if stretch:
        secret = _stretched(secret)  # what the agent keys its proofs from
    sock = connect_raw(address, source=source)
    cn, sid, sinc, sn = hello_and_challenge(sock, client_id, incarnation)
    sock.sendall(
        frame_header(PROOF, 32)
        + _proof(secret, b"client", cn, sn, client_id, sid, incarnation, sinc)
    )
    try:
        hdr = recv_exact(sock, 24)
        if struct.unpack("<IBBHIIQ", hdr)[2] != PROOF:
            return sock, False
        server_proof = recv_exact(sock, 32)
    except (ConnectionError, OSError):
        return sock, False  # refused: closed without a proof
    expected = _proof(secret, b"server", cn, sn, client_id, sid, incarnation, sinc)
    return sock, hmac.compare_digest(server_proof, expected)
