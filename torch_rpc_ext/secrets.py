# SPDX-License-Identifier: BSD-3-Clause
"""What a user's group secret becomes before the agent uses it.

A secret given in the options or ``TORCH_RPC_EXT_SECRET`` is often a
passphrase, not 32 random bytes, and any worker answers a hello with a proof
keyed from it (docs/security.md): someone who records one handshake can try
guesses offline. So every user secret is stretched once, at ``init_rpc``,
with PBKDF2-HMAC-SHA256 (600,000 rounds: about 0.15 s on a 2 GHz core, the
same for every guess), and one that is plainly weak is refused. Every worker
stretches alike (same salt, same rounds), so the keys agree; the secret made
for a group that gives none (``secret=None``) is 32 random bytes already and
is not stretched.
"""

import hashlib

__all__ = ["KDF_ROUNDS", "stretch", "weakness"]

KDF_ROUNDS = 600_000
_SALT = b"torch_rpc_ext/secret/v1"
MIN_DISTINCT = 8


def weakness(secret: bytes) -> str:
    """Why `secret` is too weak to use ("" if it is not): fewer than 8
    distinct bytes, or one short run repeated. (Its length is the option
    spec's to check: the callers do, first.)"""
    distinct = len(set(secret))
    if distinct < MIN_DISTINCT:
        return f"it has {distinct} distinct bytes (at least {MIN_DISTINCT} needed)"
    for unit in range(1, len(secret) // 2 + 1):
        if len(secret) % unit == 0 and secret == secret[:unit] * (len(secret) // unit):
            return f"it repeats its first {unit} bytes"
    return ""


def stretch(secret: bytes) -> bytes:
    """The 32-byte key the agent derives its proofs and TLS key from."""
    return hashlib.pbkdf2_hmac("sha256", secret, _SALT, KDF_ROUNDS)
