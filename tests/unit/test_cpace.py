# SPDX-License-Identifier: BSD-3-Clause
"""The key exchange a TLS connection keyed by the group's secret runs first
(csrc/common/cpace.h): Elligator 2 against RFC 9380's vectors and a plain
Python rendering of the RFC's steps, and both ends of an exchange deriving
one key only when they start from one secret and one session."""

import os
import random

import pytest

from torch_rpc_ext import _testing

P = 2**255 - 19
A = 486662

# RFC 9380, appendix J.4.1 (curve25519_XMD:SHA-512_ELL2_RO_: u[0] -> Q0.x,
# u[1] -> Q1.x, each Q the map's output before any addition) and J.4.2
# (..._NU_: u[0] -> Q.x), as the RFC prints them (big-endian), from
# cfrg/draft-irtf-cfrg-hash-to-curve's poc/vectors at 664b135.
RFC9380 = [
    ("005fe8a7b8fef0a16c105e6cadf5a6740b3365e18692a9c05bfbb4d97f645a6a",
     "36b4df0c864c64707cbf6cf36e9ee2c09a6cb93b28313c169be29561bb904f98"),
    ("1347edbec6a2b5d8c02e058819819bee177077c9d10a4ce165aab0fd0252261a",
     "3fa114783a505c0b2b2fbeef0102853c0b494e7757f2a089d0daae7ed9a0db2b"),
    ("49bed021c7a3748f09fa8cdfcac044089f7829d3531066ac9e74e0994e05bc7d",
     "16b3d86e056b7970fa00165f6f48d90b619ad618791661b7b5e1ec78be10eac1"),
    ("5c36525b663e63389d886105cee7ed712325d5a97e60e140aba7e2ce5ae851b6",
     "7ec29ddbf34539c40adfa98fcb39ec36368f47f30e8f888cc7e86f4d46e0c264"),
    ("6412b7485ba26d3d1b6c290a8e1435b2959f03721874939b21782df17323d160",
     "71de3dadfe268872326c35ac512164850860567aea0e7325e6b91a98f86533ad"),
    ("24c7b46c1c6d9a21d32f5707be1380ab82db1054fde82865d5c9e3d968f287b2",
     "5704069021f61e41779e2ba6b932268316d6d2a6f064f997a22fef16d1eaeaca"),
    ("5e123990f11bbb5586613ffabdb58d47f64bb5f2fa115f8ea8df0188e0c9e1b5",
     "7a94d45a198fb5daa381f45f2619ab279744efdd8bd8ed587fc5b65d6cea1df0"),
    ("5e8553eb00438a0bb1e7faa59dec6d8087f9c8011e5fb8ed9df31cb6c0d4ac19",
     "30506fb7a32136694abd61b6113770270debe593027a968a01f271e146e60c18"),
    ("20f481e85da7a3bf60ac0fb11ed1d0558fc6f941b3ac5469aa8b56ec883d6d7d",
     "02d606e2699b918ee36f2818f2bc5013e437e673c9f9b9cdc15fd0c5ee913970"),
    ("017d57fd257e9a78913999a23b52ca988157a81b09c5442501d07fed20869465",
     "38920e9b988d1ab7449c0fa9a6058192c0c797bb3d42ac345724341a1aa98745"),
    ("608d892b641f0328523802a6603427c26e55e6f27e71a91a478148d45b5093cd",
     "51125222da5e763d97f3c10fcc92ea6860b9ccbbd2eb1285728f566721c1e65b"),
    ("46f5b22494bfeaa7f232cc8d054be68561af50230234d7d1d63d1d9abeca8da5",
     "7d56d1e08cb0ccb92baf069c18c49bb5a0dcd927eff8dcf75ca921ef7f3e6eeb"),
    ("235fe40c443766ce7e18111c33862d66c3b33267efa50d50f9e8e5d252a40aaa",
     "3fbe66b9c9883d79e8407150e7c2a1c8680bee496c62fabe4619a72b3cabe90f"),
    ("001e92a544463bda9bd04ddbe3d6eed248f82de32f522669efc5ddce95f46f5b",
     "227e0bb89de700385d19ec40e857db6e6a3e634b1c32962f370d26f84ff19683"),
    ("1a68a1af9f663592291af987203393f707305c7bac9c8d63d6a729bdc553dc19",
     "3bcd651ee54d5f7b6013898aab251ee8ecc0688166fce6e9548d38472f6bd196"),
]


def le(n: int) -> bytes:
    return n.to_bytes(32, "little")


def is_square(x: int) -> bool:
    return pow(x, (P - 1) // 2, P) in (0, 1)


def elligator2(u: int) -> int:
    """RFC 9380, section 6.7.1, for Curve25519 (J = A, K = 1, Z = 2), as the
    RFC writes it: the u-coordinate only."""
    d = (1 + 2 * u * u) % P
    x1 = (-A * pow(d, P - 2, P)) % P
    if x1 == 0:
        x1 = -A % P
    gx1 = (x1**3 + A * x1**2 + x1) % P
    x2 = (-x1 - A) % P
    return x1 if is_square(gx1) else x2


@pytest.mark.parametrize("u, x", RFC9380)
def test_elligator2_gives_rfc_9380s_points(u, x):
    got = _testing.elligator2(bytes.fromhex(u)[::-1])
    assert got[::-1].hex() == x


def test_elligator2_agrees_with_the_rfcs_steps_and_lands_on_the_curve():
    rng = random.Random(105)
    specials = [0, 1, 2, P - 1, P - 2, A, P - A, (P - 1) // 2, 2**254, 2**255 - 20]
    for u in specials + [rng.randrange(P) for _ in range(300)]:
        got = int.from_bytes(_testing.elligator2(le(u)), "little")
        assert got == elligator2(u), u
        assert got < P
        # A point of Curve25519 (v^2 = u^3 + A u^2 + u), not of its twist.
        assert is_square((got**3 + A * got**2 + got) % P), u


def test_elligator2_reads_its_input_modulo_p_and_ignores_the_top_bit():
    for u in (0, 5, 18):
        want = _testing.elligator2(le(u))
        assert _testing.elligator2(le(u + P)) == want  # u + p < 2^255
        top = bytearray(le(u))
        top[31] |= 0x80
        assert _testing.elligator2(bytes(top)) == want
    with pytest.raises(ValueError, match="32-byte field element, not 31 bytes"):
        _testing.elligator2(b"\0" * 31)


def exchange(key_a, key_b, sid=b"s" * 16, sid_b=None):
    a = _testing.CpaceExchange(key_a, sid)
    b = _testing.CpaceExchange(key_b, sid if sid_b is None else sid_b)
    return a.share, b.share, a.finish(b.share, True), b.finish(a.share, False)


def test_both_ends_derive_one_key_from_one_secret_and_session():
    key = os.urandom(32)
    share_a, share_b, ka, kb = exchange(key, key)
    assert len(ka) == 32 and ka == kb
    # Fresh scalars each time: fresh shares, a fresh key.
    again = exchange(key, key)
    assert again[2] == again[3]
    assert {share_a, share_b}.isdisjoint(again[:2]) and again[2] != ka
    # The generator depends on both the key and the session.
    g = _testing.cpace_generator(key, b"s" * 16)
    assert g != _testing.cpace_generator(key, b"t" * 16)
    assert g != _testing.cpace_generator(os.urandom(32), b"s" * 16)


def test_another_secret_or_session_derives_another_key():
    key = os.urandom(32)
    other = bytearray(key)
    other[0] ^= 1
    _, _, ka, kb = exchange(key, bytes(other))
    assert ka != kb
    _, _, ka, kb = exchange(key, key, sid=b"s" * 16, sid_b=b"S" + b"s" * 15)
    assert ka != kb
    # Each end's role orders the transcript: two clients agree on nothing.
    a = _testing.CpaceExchange(key, b"s" * 16)
    b = _testing.CpaceExchange(key, b"s" * 16)
    assert a.finish(b.share, True) != b.finish(a.share, True)


def test_a_share_of_small_order_or_the_wrong_size_is_refused():
    a = _testing.CpaceExchange(os.urandom(32), b"s" * 16)
    # u = 0 and u = 1 are of order 2 and 4: X25519 gives all zeros.
    for bad in (b"\0" * 32, le(1)):
        with pytest.raises(RuntimeError, match="X25519"):
            a.finish(bad, True)
    with pytest.raises(RuntimeError, match="31 bytes, not 32"):
        a.finish(b"\1" * 31, True)
