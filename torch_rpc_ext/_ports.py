# SPDX-License-Identifier: BSD-3-Clause
"""A free loopback port for ``MASTER_PORT``, one that stays free until bound."""

import random
import socket


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the kernel's ephemeral range.

    The usual recipe (bind to port 0, read the port, close) picks from the
    ephemeral range, from which the kernel also gives every ``connect()`` its
    local port: between the pick and the store binding it, any process's
    outgoing connection can take it, and ``init_rpc`` fails with EADDRINUSE
    (seen under parallel tests and in the tutorials). Below the range only an
    explicit bind can take it. Tried at random; the kernel's pick if none of
    64 binds (or the range starts too low to leave room)."""
    low = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(64 if low > 10_100 else 0):
        port = pick.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
