# SPDX-License-Identifier: BSD-3-Clause
"""HMAC-SHA256 (libcrypto's) against RFC 4231 and hmac, AES-128-GCM (the
lanes' records) against the GCM specification's test vectors, and
frame-header validation."""

import hmac
import os
import random
import re
import struct

import pytest

from torch_rpc_ext import _testing

MAGIC = _testing.FRAME_MAGIC
VERSION = _testing.PROTOCOL_VERSION


def header(magic=MAGIC, version=VERSION, kind=4, flags=0, head=10, nseg=1, data=100):
    return struct.pack("<IBBHIIQ", magic, version, kind, flags, head, nseg, data)


# RFC 4231 section 4: (key, data, HMAC-SHA-256). Case 5's is truncated to
# 128 bits there, so only that prefix is compared.
RFC4231 = [
    (b"\x0b" * 20, b"Hi There",
     "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?",
     "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50,
     "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (bytes(range(1, 26)), b"\xcd" * 50,
     "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"),
    (b"\x0c" * 20, b"Test With Truncation",
     "a3b6167473100ee06e0c796c2955552b"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131,
     b"This is a test using a larger than block-size key and a larger than "
     b"block-size data. The key needs to be hashed before being used by the "
     b"HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]


@pytest.mark.parametrize("case", range(1, 8))
def test_hmac_rfc4231(case):
    key, data, expected = RFC4231[case - 1]
    digest = _testing.hmac_sha256(key, data)
    assert len(digest) == 32
    assert digest.hex()[: len(expected)] == expected


@pytest.mark.parametrize("keylen", [0, 16, 64, 65, 200])
@pytest.mark.parametrize("msglen", [0, 143, 100_000])
def test_hmac_matches_stdlib(keylen, msglen):
    key = bytes(range(keylen % 256)) * (keylen // 256 + 1)
    key = key[:keylen]
    msg = (b"torch_rpc_ext" * (msglen // 13 + 1))[:msglen]
    assert _testing.hmac_sha256(key, msg) == hmac.new(key, msg, "sha256").digest()


def test_hkdf_expand_rfc5869():
    # RFC 5869, A.1 and A.2 (the Expand step, from their PRKs), and a
    # cross-check against HMAC by hand for one block.
    prk = bytes.fromhex("077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    okm = "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    assert _testing.hkdf_expand(prk, info, 42).hex() == okm
    prk = bytes.fromhex("06a6b88c5853361a06104c9ceb35b45cef760014904671014a193f40c15fc244")
    info = bytes(range(0xB0, 0x100))
    okm = (
        "b11e398dc80327a1c8e7f78c596a49344f012eda2d4efad8a050cc4c19afa97c59045a99cac7827271cb41c65e590e09"
        "da3275600c2f09b8367793a9aca3db71cc30c58179ec3e87c14c01d5c1f3434f1d87"
    )
    assert _testing.hkdf_expand(prk, info, 82).hex() == okm
    key, info = os.urandom(32), b"lane"
    assert _testing.hkdf_expand(key, info, 16) == hmac.new(key, info + b"\x01", "sha256").digest()[:16]
    with pytest.raises(ValueError):
        _testing.hkdf_expand(key, info, 255 * 32 + 1)


def test_hmac_comes_from_libcrypto():
    # "<OpenSSL version text> (<file>)": the file dladdr() found HMAC in.
    m = re.fullmatch(r"(\S+ \d+\.\d+\S*.*) \((/.+)\)", _testing.libcrypto())
    assert m, _testing.libcrypto()
    assert os.path.basename(m.group(2)).startswith("libcrypto"), m.group(2)
    assert os.path.isfile(m.group(2))


def test_valid_header_passes():
    assert _testing.validate_header(header(), 1 << 20) == ""


@pytest.mark.parametrize("kind", [1, 6, 16, 23, 24, 255])
def test_transport_and_channel_kinds_pass_the_header_check(kind):
    # Kinds from 16 up belong to channels; whether the connection negotiated
    # the channel is checked later, by the connection.
    assert _testing.validate_header(header(kind=kind, nseg=0, data=0), 1 << 20) == ""


@pytest.mark.parametrize("flags, kind", [(1, 4), (2, 4), (4, 4), (4, 5), (4, 16)])
def test_frame_flags_pass_the_header_check_on_their_kinds(flags, kind):
    # Chunked segments and a body on the socket belong to messages; a
    # carrier's flag to any frame. Whether the connection has the ring the
    # last two need is checked later, by the connection.
    assert _testing.validate_header(header(kind=kind, flags=flags), 1 << 20) == ""


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"magic": 0x12345678}, "bad magic"),
        ({"version": 99}, "unsupported protocol version 99"),
        ({"flags": 8}, "reserved flags"),
        ({"flags": 3}, "reserved flags"),  # chunked and body on the socket at once
        ({"flags": 6}, "reserved flags"),  # one flag a frame
        ({"flags": 1, "kind": 1}, "reserved flags"),  # chunked on a handshake frame
        ({"flags": 2, "kind": 5}, "reserved flags"),  # a body on the socket: messages only
        ({"kind": 0}, "unknown frame kind 0"),
        ({"kind": 8}, "unknown frame kind 8"),  # 8..15: reserved (7: frame ring)
        ({"kind": 15}, "unknown frame kind 15"),
        ({"data": 1 << 21}, "exceeds max_frame_bytes=1048576"),
        ({"data": (1 << 64) - 1}, "exceeds max_frame_bytes"),
        ({"head": 1 << 30}, "head of 1073741824 bytes exceeds"),
        ({"nseg": 1 << 20}, "segments exceed"),
    ],
)
def test_bad_headers_are_rejected_before_allocation(fields, reason):
    assert reason in _testing.validate_header(header(**fields), 1 << 20)


# McGrew and Viega, "The Galois/Counter Mode of Operation", test cases 3
# and 4 (AES-128, 96-bit IV): key, IV, AAD, plaintext, ciphertext, tag.
_GCM_P = bytes.fromhex(
    "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
    "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255")
_GCM_C = bytes.fromhex(
    "42831ec2217774244b7221b784d0d49ce3aa212f2c02a4e035c17e2329aca12e"
    "21d514b25466931c7d8f6a5aac84aa051ba30b396a0aac973d58e091473f5985")
GCM = [
    (bytes.fromhex("feffe9928665731c6d6a8f9467308308"), bytes.fromhex("cafebabefacedbaddecaf888"),
     b"", _GCM_P, _GCM_C, bytes.fromhex("4d5c2af327cd64a62cf35abd2ba6fab4")),
    (bytes.fromhex("feffe9928665731c6d6a8f9467308308"), bytes.fromhex("cafebabefacedbaddecaf888"),
     bytes.fromhex("feedfacedeadbeeffeedfacedeadbeefabaddad2"), _GCM_P[:60], _GCM_C[:60],
     bytes.fromhex("5bc94fbc3221a5db94fae95ae7121a47")),
]


# Both engines of Aead (csrc/common/crypto.h): libcrypto's EVP, and our
# AVX-512 VAES code (csrc/common/aes_gcm_vaes.cpp) where this CPU runs it.
ENGINES = [
    "libcrypto",
    pytest.param("vaes", marks=pytest.mark.skipif(
        not _testing.aes_gcm_vaes_supported(), reason="this CPU has no AVX-512 VAES")),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", GCM, ids=["gcm3", "gcm4"])
def test_aead_matches_the_gcm_test_vectors(case, engine):
    key, iv, aad, plain, sealed, tag = case
    assert _testing.aead_seal(key, iv, aad, plain, engine) == (sealed, tag)
    assert _testing.aead_open(key, iv, aad, sealed, tag, engine) == plain
    assert _testing.aead_open(key, iv, aad, sealed, tag, engine, in_place=True) == plain


@pytest.mark.parametrize("engine", ENGINES)
def test_aead_refuses_any_change_to_bytes_header_nonce_or_key(engine):
    key, nonce, aad = os.urandom(16), os.urandom(12), b"header" * 5
    plain = os.urandom(300_000)
    sealed, tag = _testing.aead_seal(key, nonce, aad, plain, engine)
    assert _testing.aead_open(key, nonce, aad, sealed, tag, engine) == plain
    flipped = bytearray(sealed)
    flipped[123_456] ^= 1
    assert _testing.aead_open(key, nonce, aad, bytes(flipped), tag, engine) is None
    assert _testing.aead_open(key, nonce, b"Header" + aad[6:], sealed, tag, engine) is None
    assert _testing.aead_open(key, bytes(12), aad, sealed, tag, engine) is None
    assert _testing.aead_open(os.urandom(16), nonce, aad, sealed, tag, engine) is None
    with pytest.raises(ValueError, match="16 bytes"):
        _testing.aead_seal(b"short", nonce, aad, plain, engine)


vaes_only = pytest.mark.skipif(not _testing.aes_gcm_vaes_supported(),
                               reason="this CPU has no AVX-512 VAES")


@vaes_only
def test_vaes_gives_libcryptos_bytes_and_tags_at_every_length():
    """Every length from 0 to 600 bytes (the sixteen-block steps, the
    single blocks after them, a partial last block) and larger odd ones, each
    with its own key, nonce and header of 0-69 bytes: the same ciphertext and
    tag as libcrypto's, and each opens the other's, in place or not."""
    rng = random.Random(48)
    sizes = list(range(601)) + [4095, 4096, 4097, 65_536 + 17, 262_144, 262_144 + 31]
    for size in sizes:
        key, nonce = rng.randbytes(16), rng.randbytes(12)
        aad, plain = rng.randbytes(rng.randrange(70)), rng.randbytes(size)
        ours = _testing.aead_seal(key, nonce, aad, plain, "vaes")
        assert ours == _testing.aead_seal(key, nonce, aad, plain, "libcrypto"), size
        assert _testing.aead_open(key, nonce, aad, *ours, "libcrypto") == plain, size
        assert _testing.aead_open(key, nonce, aad, *ours, "vaes", in_place=size % 2 == 0) == plain


@vaes_only
def test_vaes_refuses_a_flipped_bit_anywhere():
    """A bit changed in any byte of a record (each position of a sixteen-
    block step and of the blocks after it) or of its tag fails the check."""
    key, nonce, aad = os.urandom(16), os.urandom(12), b"h" * 32
    plain = os.urandom(300)
    sealed, tag = _testing.aead_seal(key, nonce, aad, plain, "vaes")
    for i in range(len(sealed)):
        changed = bytearray(sealed)
        changed[i] ^= 1 << (i % 8)
        assert _testing.aead_open(key, nonce, aad, bytes(changed), tag, "vaes") is None, i
    for i in range(16):
        changed = bytearray(tag)
        changed[i] ^= 0x80
        assert _testing.aead_open(key, nonce, aad, sealed, bytes(changed), "vaes") is None, i


def test_the_engine_follows_the_environment(monkeypatch):
    monkeypatch.delenv("TORCH_RPC_EXT_AES_GCM", raising=False)
    best = "vaes" if _testing.aes_gcm_vaes_supported() else "libcrypto"
    assert _testing.aead_engine() == best
    monkeypatch.setenv("TORCH_RPC_EXT_AES_GCM", "libcrypto")
    assert _testing.aead_engine() == "libcrypto"
    monkeypatch.setenv("TORCH_RPC_EXT_AES_GCM", "fastest")
    with pytest.raises(ValueError, match="TORCH_RPC_EXT_AES_GCM=fastest: expected auto"):
        _testing.aead_engine()
    with pytest.raises(ValueError, match="TORCH_RPC_EXT_AES_GCM=fastest"):
        _testing.aead_seal(bytes(16), bytes(12), b"", b"x")


def test_a_cpu_without_vaes_gets_libcrypto_and_an_error_if_it_asks(monkeypatch):
    if _testing.aes_gcm_vaes_supported():  # play the CPU without it
        monkeypatch.setenv("TORCH_RPC_EXT_TEST_NO_VAES", "1")
    monkeypatch.delenv("TORCH_RPC_EXT_AES_GCM", raising=False)
    assert _testing.aead_engine() == "libcrypto"
    sealed = _testing.aead_seal(bytes(16), bytes(12), b"", b"x")
    assert sealed == _testing.aead_seal(bytes(16), bytes(12), b"", b"x", "libcrypto")
    monkeypatch.setenv("TORCH_RPC_EXT_AES_GCM", "vaes")
    with pytest.raises(RuntimeError, match="needs a CPU with AVX-512 F/BW/VL, VAES"):
        _testing.aead_seal(bytes(16), bytes(12), b"", b"x")
