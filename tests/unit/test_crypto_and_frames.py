# SPDX-License-Identifier: BSD-3-Clause
"""Our SHA-256/HMAC against hashlib, and frame-header validation."""

import hashlib
import hmac
import struct

import pytest

from torch_rpc_ext._C import _testing

MAGIC = _testing.FRAME_MAGIC
VERSION = _testing.PROTOCOL_VERSION


def header(magic=MAGIC, version=VERSION, kind=4, flags=0, head=10, nseg=1, data=100):
    return struct.pack("<IBBHIIQ", magic, version, kind, flags, head, nseg, data)


@pytest.mark.parametrize("n", [0, 1, 55, 56, 63, 64, 65, 1000, 100_000])
def test_sha256_matches_hashlib(n):
    data = bytes(range(256)) * (n // 256 + 1)
    assert _testing.sha256(data[:n]) == hashlib.sha256(data[:n]).digest()


@pytest.mark.parametrize("keylen", [0, 16, 64, 65, 200])
def test_hmac_matches_stdlib(keylen):
    key = bytes(range(keylen % 256)) * (keylen // 256 + 1)
    key = key[:keylen]
    msg = b"torch_rpc_ext" * 11
    assert _testing.hmac_sha256(key, msg) == hmac.new(key, msg, "sha256").digest()


def test_valid_header_passes():
    assert _testing.validate_header(header(), 1 << 20) == ""


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"magic": 0x12345678}, "bad magic"),
        ({"version": 99}, "unsupported protocol version 99"),
        ({"flags": 2}, "reserved flags"),
        ({"flags": 1, "kind": 1}, "reserved flags"),  # ring flag on a handshake frame
        ({"kind": 0}, "unknown frame kind 0"),
        ({"kind": 200}, "unknown frame kind 200"),
        ({"data": 1 << 21}, "exceeds max_frame_bytes=1048576"),
        ({"data": (1 << 64) - 1}, "exceeds max_frame_bytes"),
        ({"head": 1 << 30}, "head of 1073741824 bytes exceeds"),
        ({"nseg": 1 << 20}, "segments exceed"),
    ],
)
def test_bad_headers_are_rejected_before_allocation(fields, reason):
    assert reason in _testing.validate_header(header(**fields), 1 << 20)
