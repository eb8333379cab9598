# SPDX-License-Identifier: BSD-3-Clause
"""A live agent facing raw sockets: wrong secret, wrong version, garbage,
oversized frames. Each is refused and counted; legitimate calls keep working."""

import os
import socket
import struct

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

from tests.rpc.world import init, run_world
from torch_rpc_ext import _C
from torch_rpc_ext.testing import (
    HELLO,
    MESSAGE,
    PROOF,
    closed_by_peer,
    connect_raw,
    frame_header,
    handshake,
    recv_exact,
)

pytestmark = pytest.mark.timeout(120)

SECRET = b"0123456789abcdefghijklmnopqrstuv"


def cached_operators():
    return int(rpc.api._get_current_rpc_agent().get_metrics()["rpc_ext.cached_operators"])


def call_operator(addr, args, schema, expect):
    """An authenticated peer calls a builtin operator by its schema text with
    `args`; returns (the bytes it got back within 15 s, or up to `expect`;
    the connection still open?)."""
    import pickle

    from torch_rpc_ext import _testing

    sock, _ = handshake(addr, SECRET)
    # Upstream's SCRIPT_CALL layout: (args..., schema text, qualified name).
    payload = pickle.dumps((*args, schema, "torch.ops.aten.add"), protocol=2)
    head, segs = _testing.encode_message(0x100, payload, [], 77)
    sock.sendall(frame_header(MESSAGE, len(head), nseg=len(segs), data=sum(map(len, segs)))
                 + b"".join(struct.pack("<Q", len(x)) for x in segs) + head + b"".join(segs))
    sock.settimeout(15)  # the loop ends as the answer arrives
    got = b""
    try:
        while expect not in got:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    except socket.timeout:
        pass
    sock.settimeout(0.3)
    still_open = not closed_by_peer(sock)
    sock.close()
    return got, still_open


def my_address():
    return rpc.api._get_current_rpc_agent().address


def rejected():
    return int(rpc.api._get_current_rpc_agent().get_metrics()["rpc_ext.rejected_connections"])


def attacks(rank, world_size):
    init(rank, world_size, secret=SECRET)
    out = {}
    if rank == 0:
        addr = rpc.rpc_sync("worker1", my_address)
        before = rpc.rpc_sync("worker1", rejected)

        # 1. Wrong secret: our proof is refused, and the server closes
        #    without a proof of its own.
        sock, ok = handshake(addr, b"not-the-secret-at-all-0123456789")
        out["wrong_secret_server_proof_ok"] = ok
        out["wrong_secret_closed"] = closed_by_peer(sock)
        sock.close()
        # 1b. Nothing a stranger gets is computed from the secret (no
        #     offline guessing oracle): the challenge is an id, an
        #     incarnation and a nonce, and a wrong proof gets no bytes back.
        s = connect_raw(addr)
        s.sendall(frame_header(HELLO, 44) + struct.pack("<iQ", 0, 0) + os.urandom(32))
        challenge = struct.unpack("<IBBHIIQ", recv_exact(s, 24))
        out["challenge_head_bytes"] = challenge[4]
        recv_exact(s, challenge[4])
        s.sendall(frame_header(PROOF, 32) + os.urandom(32))
        s.settimeout(5)
        try:
            out["after_wrong_proof"] = s.recv(65536)
        except ConnectionResetError:
            out["after_wrong_proof"] = b""
        s.close()

        # 2. Right secret: mutual proof verifies and the connection stays up.
        sock, ok = handshake(addr, SECRET)
        out["right_secret_server_proof_ok"] = ok
        sock.settimeout(0.5)
        out["right_secret_stays_open"] = not closed_by_peer(sock)
        #    ...then a frame whose head lies about its tensors is refused.
        sock.settimeout(5)
        bad_head = struct.pack("<Iqi", 0x10C, 1, 1) + b"\x00" * 30
        sock.sendall(frame_header(MESSAGE, len(bad_head), nseg=1, data=0)
                     + struct.pack("<Q", 0) + bad_head)
        out["bad_head_closed"] = closed_by_peer(sock)
        sock.close()

        # 2b. Right secret but a worker id outside the group (ids index the
        #     agent's per-peer tables): refused in the handshake.
        for bad_id in (world_size, (1 << 31) - 1):
            try:
                sock, _ = handshake(addr, SECRET, client_id=bad_id)
                sock.settimeout(5)  # under the 10 s timeouts that close a silent socket
                sock.sendall(frame_header(MESSAGE, len(bad_head), nseg=1, data=0)
                             + struct.pack("<Q", 0) + bad_head)
                out[f"id_{bad_id}_refused"] = closed_by_peer(sock)
                sock.close()
            except (ConnectionError, OSError):
                out[f"id_{bad_id}_refused"] = True

        # 3. Wrong protocol version, 4. garbage, 5. an absurd length: each is
        #    closed after the 24-byte header, before anything is allocated.
        host, port = addr.rsplit(":", 1)
        for label, data in [
            ("wrong_version", frame_header(HELLO, 44, version=_C.PROTOCOL_VERSION + 1) + bytes(44)),
            ("garbage", os.urandom(4096)),
            ("absurd_length", frame_header(HELLO, 44, nseg=0, data=1 << 62)),
            ("message_before_auth", frame_header(MESSAGE, 8) + bytes(8)),
        ]:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(data)
            out[label] = closed_by_peer(s)
            s.close()

        # 6. An authenticated call of an operator that does not exist gets an
        #    error response naming it, and is not remembered as an operator.
        cached = rpc.rpc_sync("worker1", cached_operators)
        got, out["unknown_op_open"] = call_operator(
            addr, (1.0, 2.0), "aten::add.Bogus(Tensor self) -> Tensor", b"Bogus")
        out["unknown_op_answered"] = b"aten::add.Bogus" in got
        out["unknown_op_cached"] = rpc.rpc_sync("worker1", cached_operators) - cached

        # 7. A real operator with fewer or more arguments than its schema
        #    has: the kernel read below its stack (the callee died) or the
        #    reply blamed its results. Now an error response naming both.
        add = "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"
        for label, args in (("no_args", ()), ("one_arg", (1.0,)),
                            ("four_args", (1.0, 2.0, 1, 1))):
            got, still_open = call_operator(addr, args, add, b"arguments")
            out[label] = (b"takes 3 arguments, the request carries %d" % len(args) in got, still_open)

        # The agent still serves its real peers, and counted every refusal.
        out["still_serves"] = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        out["rejected_delta"] = rpc.rpc_sync("worker1", rejected) - before
    rpc.shutdown()
    return out


def test_agent_refuses_strangers_and_keeps_serving():
    out = run_world(attacks)[0]
    assert out["wrong_secret_server_proof_ok"] is False
    assert out["wrong_secret_closed"]
    assert out["challenge_head_bytes"] == 44  # id, incarnation, nonce: no proof
    assert out["after_wrong_proof"] == b""
    assert out["right_secret_server_proof_ok"] is True
    assert out["right_secret_stays_open"]
    assert out["bad_head_closed"]
    assert out["id_2_refused"] and out["id_2147483647_refused"]
    for label in ["wrong_version", "garbage", "absurd_length", "message_before_auth"]:
        assert out[label], label
    assert out["unknown_op_answered"] and out["unknown_op_open"]
    assert out["unknown_op_cached"] == 0
    for label in ("no_args", "one_arg", "four_args"):
        assert out[label] == (True, True), (label, out[label])
    assert torch.equal(out["still_serves"], torch.full((2,), 2.0))
    # 2 wrong secrets + 2 ids outside the group + 4 pre-auth rejections (the
    # bad head came after auth).
    assert out["rejected_delta"] == 8


def mismatched_secrets(rank, world_size, both_refused):
    secret = SECRET if rank == 0 else b"another-secret-another-secret-!!"
    init(rank, world_size, secret=secret, rpc_timeout=5)
    err = None
    try:
        rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), 1))
    except RuntimeError as e:
        err = str(e)
    both_refused.wait(60)  # keep serving until the other side has seen our proof too
    rpc.api._get_current_rpc_agent().shutdown()
    return err


def test_workers_with_different_secrets_cannot_talk():
    errs = run_world(mismatched_secrets, both_refused=mp.get_context("fork").Barrier(2))
    for rank, err in errs.items():
        assert err is not None
        assert f"worker{1 - rank}" in err and "authentication failed" in err
