# SPDX-License-Identifier: BSD-3-Clause
"""The encryption, mutual-TLS and hold-off options of
``RpcExtBackendOptions``, from their arguments or the environment, checked
(docs/security.md)."""

import ipaddress
import os
from collections.abc import Iterable, Sequence

_ENCRYPTION = ("auto", "always", "off")
_TLS_FILES = (("tls_cert", "TORCH_RPC_EXT_TLS_CERT"), ("tls_key", "TORCH_RPC_EXT_TLS_KEY"),
              ("tls_ca", "TORCH_RPC_EXT_TLS_CA"))


def check_peer_names(names: Sequence[str] | None, mutual: bool) -> tuple[str, ...]:
    """``tls_peer_names`` from the argument or TORCH_RPC_EXT_TLS_PEER_NAMES,
    checked: non-empty patterns without NUL or comma, and only with mutual
    TLS (a pre-shared key has no certificate to match)."""
    source = "tls_peer_names"
    if names is None:
        text = os.environ.get("TORCH_RPC_EXT_TLS_PEER_NAMES", "")
        names = [n.strip() for n in text.split(",")] if text.strip() else []
        source = "TORCH_RPC_EXT_TLS_PEER_NAMES"
    elif isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"tls_peer_names must be a sequence of patterns, got {names!r}")
    names = tuple(names)
    for n in names:
        if not n or "\0" in n or "," in n:
            raise ValueError(f"{source}: {n!r} is not a name pattern (empty, or with NUL or comma)")
    if names and not mutual:
        raise ValueError(
            f"{source} needs mutual TLS (tls_cert, tls_key, tls_ca): without "
            "certificates there are no names to check"
        )
    return names


def check_hold_off_exempt(entries: Sequence[str] | None) -> tuple[str, ...]:
    """``hold_off_exempt`` from the argument or TORCH_RPC_EXT_HOLD_OFF_EXEMPT
    (comma-separated), checked: IPv4 or IPv6 addresses and networks
    (``10.0.0.0/8``, ``fd00::/8``), without host bits past the prefix or a
    scope; each as ``ipaddress`` writes its network (``10.0.0.7/32``)."""
    source = "hold_off_exempt"
    if entries is None:
        text = os.environ.get("TORCH_RPC_EXT_HOLD_OFF_EXEMPT", "")
        entries = [e.strip() for e in text.split(",")] if text.strip() else []
        source = "TORCH_RPC_EXT_HOLD_OFF_EXEMPT"
    else:
        if not isinstance(entries, str) and isinstance(entries, Iterable):
            entries = tuple(entries)  # (a generator is read once)
        if isinstance(entries, str) or not isinstance(entries, tuple) or not all(
                isinstance(e, str) for e in entries):
            raise ValueError(f"hold_off_exempt must be a sequence of addresses or networks, got {entries!r}")
    networks = []
    for e in entries:
        try:
            if "%" in e:
                raise ValueError("a scoped address names no network")
            networks.append(str(ipaddress.ip_network(e)))
        except ValueError as err:
            raise ValueError(
                f"{source}: {e!r} is not an address or a network such as 10.0.0.0/8 or fd00::/8 ({err})"
            ) from None
    return tuple(networks)


def check_encryption(
    encryption: str | None, cert: str | None, key: str | None, ca: str | None, default: str
) -> tuple[str, tuple[str | None, str | None, str | None]]:
    """The encryption mode and the mutual TLS files, from the arguments or
    the environment (else ``default``), checked: a mode of ``_ENCRYPTION``,
    and the three files together, each one readable."""
    where = "encryption"
    if encryption is None:
        encryption = os.environ.get("TORCH_RPC_EXT_ENCRYPTION") or default
        where = "TORCH_RPC_EXT_ENCRYPTION" if os.environ.get("TORCH_RPC_EXT_ENCRYPTION") else where
    if encryption not in _ENCRYPTION:
        raise ValueError(
            f'{where} must be "auto", "always" or "off", got {encryption!r}'
        )
    resolved = []
    for value, (name, env) in zip((cert, key, ca), _TLS_FILES):
        source = name
        if value is None and os.environ.get(env):
            value, source = os.environ[env], env
        if value is not None:
            if not isinstance(value, (str, os.PathLike)) or not str(value):
                raise ValueError(f"{source} must be a path, got {value!r}")
            value = str(value)
            if not os.path.isfile(value) or not os.access(value, os.R_OK):
                raise ValueError(f"{source}: {value!r} is not a readable file")
        resolved.append(value)
    given = [name for value, (name, _) in zip(resolved, _TLS_FILES) if value is not None]
    if given and len(given) != 3:
        missing = [name for name, _ in _TLS_FILES if name not in given]
        raise ValueError(
            f"mutual TLS needs tls_cert, tls_key and tls_ca together; "
            f"{', '.join(given)} given without {', '.join(missing)}"
        )
    if given and encryption == "off":
        raise ValueError('tls_cert, tls_key and tls_ca are given but encryption is "off"')
    return encryption, tuple(resolved)
