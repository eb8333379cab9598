# SPDX-License-Identifier: BSD-3-Clause
"""Hosts made of Linux network namespaces, for tests that need more than one
machine: a cross-host call must leave one network stack and arrive at
another, so the agent picks `tcp` between hosts and `shm` within one, and a
link can be cut, slowed down or given IPv6 addresses without real machines.

Layout of ``Hosts(n)`` (PREFIX is ``trxh<pid><letter>``, unique per process
and per instance, so two runs on one machine never share a name)::

      namespace PREFIXh0             namespace PREFIXbr           namespace PREFIXh1
    +--------------------+      +-------------------------+      +--------------------+
    | lo                 |      |  bridge PREFIXbr        |      | lo                 |
    | PREFIXh0 (veth) ---+------+- PREFIXp0     PREFIXp1 -+------+-- PREFIXh1 (veth)  |
    | 10.213.0.1/24      |      |  (no addresses)         |      | 10.213.0.2/24      |
    | fd00:213::1/64     |      +-------------------------+      | fd00:213::2/64     |
    | fe80::.../64       |                                       | fe80::.../64       |
    +--------------------+                                       +--------------------+

- Host i is namespace ``PREFIXh<i>``; its one interface, also named
  ``PREFIXh<i>``, is a veth whose peer ``PREFIXp<i>`` is a port of the bridge
  ``PREFIXbr``. The bridge lives in a namespace of its own (``PREFIXbr``), so
  no host sees it and nothing is created in the caller's namespace: deleting
  the namespaces deletes every interface with them.
- Host i has 10.213.0.<i+1>/24, fd00:213::<i+1>/64 (added with ``nodad``) and
  the kernel's link-local fe80:: address. Duplicate address detection is off
  in the host namespaces, so all three are usable as soon as the constructor
  returns. The subnets exist only inside these namespaces and cannot clash
  with the machine's own networks.
- ``link_down(i)`` sets the bridge's end of host i's link down: host i keeps
  its addresses and routes (its interface only loses carrier), as when a
  cable or switch port fails; ``link_up(i)`` restores the link.
- ``shape(i, rate)`` puts a tbf qdisc on both ends of host i's link (netem is
  not available on every kernel; tbf is); ``unshape(i)`` removes it.

Everything is removed when the ``with`` block ends, by an exception or an
interrupt too: processes started with ``run`` are killed (their whole process
group), then any process still inside the namespaces, then the namespaces.
Leftovers of an earlier run under the same prefix, or of a run whose process
has died (a SIGKILLed test run has no ``finally``), are deleted at start.

This file is a plain module (no pytest); conftest.py wraps it in fixtures.
Run as a script, ``netns.py ping ADDRESS`` sends one ICMP echo and prints
the round-trip time: the machines these tests run on may have no ping(8).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

NAME_PREFIX = "trxh"
IPV4_SUBNET = "10.213.0"  # host i is 10.213.0.<i+1>/24
IPV6_SUBNET = "fd00:213::"  # host i is fd00:213::<i+1>/64
IFNAMSIZ = 15  # longest interface name Linux accepts
COMMAND_TIMEOUT = 30.0  # each ip/tc command; they take milliseconds
_instances = itertools.count()


class NetnsUnavailable(RuntimeError):
    """Namespaces (or a bridge or veth pair) cannot be made here: not root,
    no iproute2, or a kernel or container that forbids it. Tests skip."""


def unavailable_reason() -> str | None:
    """Why Hosts cannot work on this machine, or None if it may."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return None


def _run(argv: Sequence[str], check: bool = True, timeout: float = COMMAND_TIMEOUT):
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise subprocess.CalledProcessError(r.returncode, list(argv), r.stdout, r.stderr)
    return r


def _namespaces() -> list[str]:
    r = _run(["ip", "netns", "list"], check=False)
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def leftovers(prefix: str = NAME_PREFIX) -> list[str]:
    """Namespaces, and interfaces of the caller's namespace, whose name
    starts with prefix: what a test checks is empty once Hosts is done."""
    found = [f"netns {ns}" for ns in _namespaces() if ns.startswith(prefix)]
    r = _run(["ip", "-o", "link", "show"], check=False)
    for line in r.stdout.splitlines():
        # "7: name@peer: <FLAGS> ..." (the @peer part only for veths).
        name = line.split(":", 2)[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(prefix):
            found.append(f"link {name}")
    return found


def _kill_namespace_processes(ns: str) -> None:
    # Only namespaces this module made and named are passed here, so every
    # process inside was started through them.
    r = _run(["ip", "netns", "pids", ns], check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete_namespaces(names: Sequence[str]) -> None:
    for ns in names:
        _kill_namespace_processes(ns)
    for ns in names:
        _run(["ip", "netns", "del", ns], check=False)


def _pid_alive(pid: int) -> bool:
    # A zombie (killed, not yet reaped) counts as dead: kill(pid, 0) would
    # still succeed on it.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def remove_stale(prefix: str | None = None) -> list[str]:
    """Delete namespaces left by this module: those under ``prefix`` and
    those whose creating process no longer exists. Returns their names."""
    stale = []
    for ns in _namespaces():
        m = re.match(rf"{NAME_PREFIX}(\d+)[a-z]", ns)
        if m is None:
            continue
        if (prefix is not None and ns.startswith(prefix)) or not _pid_alive(int(m.group(1))):
            stale.append(ns)
    _delete_namespaces(stale)
    return stale


class Hosts:
    """N network namespaces joined by a bridge; see the module docstring.

    Use as a context manager: ``with Hosts(2) as hosts: hosts.run(0, [...])``.
    """

    def __init__(self, n: int = 2, *, mtu: int | None = None) -> None:
        if not 1 <= n <= 99:
            raise ValueError(f"Hosts: n must be 1 to 99, got {n}")
        self.n = n
        self.mtu = mtu
        letter = "abcdefghijklmnopqrstuvwxyz"[next(_instances) % 26]
        self.prefix = f"{NAME_PREFIX}{os.getpid()}{letter}"
        self.bridge_ns = f"{self.prefix}br"
        self.bridge = f"{self.prefix}br"
        if len(self.ifname(n - 1)) > IFNAMSIZ:
            raise ValueError(f"Hosts: interface name {self.ifname(n - 1)!r} too long")
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces created so far

    # Names and addresses.

    def __len__(self) -> int:
        return self.n

    def ns(self, i: int) -> str:
        """Namespace of host i."""
        return f"{self.prefix}h{self._check(i)}"

    def ifname(self, i: int) -> str:
        """Host i's interface (inside its namespace)."""
        return f"{self.prefix}h{i}"

    def port(self, i: int) -> str:
        """The bridge's end of host i's link (inside the bridge namespace)."""
        return f"{self.prefix}p{self._check(i)}"

    def ipv4(self, i: int) -> str:
        return f"{IPV4_SUBNET}.{self._check(i) + 1}"

    def ipv6(self, i: int) -> str:
        """Host i's unique local (ULA) IPv6 address."""
        return f"{IPV6_SUBNET}{self._check(i) + 1:x}"

    def link_local(self, i: int, via: int | None = None) -> str:
        """Host i's IPv6 link-local address with the scope that host ``via``
        (default: host i itself, e.g. to bind to it) must use to reach it:
        ``fe80::...%<via's interface>``."""
        r = self.execute(i, ["ip", "-6", "-o", "addr", "show", "dev", self.ifname(i),
                             "scope", "link"])
        m = re.search(r"inet6 (fe80::[0-9a-f:]+)/", r.stdout)
        if m is None:
            raise RuntimeError(f"host {i} has no link-local address: {r.stdout!r}")
        return f"{m.group(1)}%{self.ifname(i if via is None else self._check(via))}"

    def _check(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"host {i} out of range (0..{self.n - 1})")
        return i

    # Setup and teardown.

    def __enter__(self) -> Hosts:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        remove_stale(self.prefix)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        self._made.append(ns)
        _run(["ip", "netns", "add", ns])

    def _build(self) -> None:
        # The first namespace, the bridge and the first veth pair show
        # whether this machine allows them at all: a failure there skips.
        try:
            self._add_ns(self.bridge_ns)
            self._add_ns(self.ns(0))
            _run(["ip", "-n", self.bridge_ns, "link", "add", self.bridge, "type", "bridge",
                  "mcast_snooping", "0"])
            self._link(0)
        except (subprocess.CalledProcessError, OSError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            raise NetnsUnavailable(f"cannot build network namespaces here: {detail.strip()}") from e
        _run(["ip", "-n", self.bridge_ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.bridge, "up"])
        for i in range(1, self.n):
            self._add_ns(self.ns(i))
            self._link(i)
        for i in range(self.n):
            self._address(i)

    def _link(self, i: int) -> None:
        ns = self.ns(i)
        # Before the veth exists, so that it inherits it: no duplicate
        # address detection, hence no seconds of "tentative" link-local.
        _run(["ip", "netns", "exec", ns, "sh", "-c",
              "echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad && "
              "echo 0 > /proc/sys/net/ipv6/conf/all/accept_dad"])
        # Made directly in the two namespaces: no name ever appears in the
        # caller's namespace, even if this is interrupted.
        _run(["ip", "-n", self.bridge_ns, "link", "add", self.port(i), "type", "veth",
              "peer", "name", self.ifname(i), "netns", ns])
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.port(i), "master", self.bridge])

    def _address(self, i: int) -> None:
        ns, dev = self.ns(i), self.ifname(i)
        if self.mtu is not None:
            _run(["ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu)])
            _run(["ip", "-n", self.bridge_ns, "link", "set", self.port(i), "mtu", str(self.mtu)])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{self.ipv4(i)}/24", "dev", dev])
        _run(["ip", "-n", ns, "addr", "add", f"{self.ipv6(i)}/64", "dev", dev, "nodad"])
        _run(["ip", "-n", ns, "link", "set", dev, "up"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.port(i), "up"])

    def close(self) -> None:
        """Kill what run() started and delete every namespace (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        _delete_namespaces(self._made)
        self._made.clear()

    # Processes.

    def run(self, i: int, argv: Sequence[str], *, timeout: float = 600,
            **popen_kwargs) -> subprocess.Popen:
        """Start argv inside host i (``ip netns exec``), killed with its
        children after ``timeout`` seconds at the latest (coreutils timeout
        runs it in a process group of its own), and when the Hosts close.
        A Python program (``sys.executable`` with ``-m``, ``-c`` or a
        script) runs as a child of forkserver.py's server, torch already
        imported (``TORCH_RPC_EXT_TEST_START=spawn``: a fresh interpreter)."""
        from tests.crosshost import (
            forkserver,  # (not at the top: this file is also a script)
        )

        if forkserver.wanted(argv, popen_kwargs.get("env")):
            argv = forkserver.client_argv(argv)
        cmd = ["ip", "netns", "exec", self.ns(i),
               "timeout", "--kill-after=5", f"{timeout:g}", *argv]
        # A session of its own from the start, so that close() can kill the
        # whole group even before timeout has made one.
        popen_kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(cmd, **popen_kwargs)
        self._procs.append(p)
        return p

    def execute(self, i: int, argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT,
                check: bool = True) -> subprocess.CompletedProcess:
        """Run argv inside host i to completion; output captured as text."""
        return _run(["ip", "netns", "exec", self.ns(i), *argv], check=check, timeout=timeout)

    def ping(self, i: int, address: str, timeout: float = 5.0) -> float:
        """One ICMP echo from host i to address (``fe80::...%ifname`` for a
        link-local one, see link_local(via=i)); its round trip in seconds.
        Raises CalledProcessError when no reply came within timeout."""
        r = self.execute(i, [sys.executable, str(Path(__file__).resolve()), "ping", address,
                             f"{timeout:g}"], timeout=timeout + COMMAND_TIMEOUT)
        return float(r.stdout.split()[-1])

    # The links.

    def link_down(self, i: int) -> None:
        """Cut host i off the bridge (its interface stays configured)."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.port(i), "down"])

    def link_up(self, i: int) -> None:
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.port(i), "up"])

    def _ends(self, i: int) -> list[tuple[str, str]]:
        return [(self.ns(i), self.ifname(i)), (self.bridge_ns, self.port(i))]

    def shape(self, i: int, rate: str = "10gbit", *, burst: str | None = None,
              latency: str = "50ms") -> None:
        """Limit host i's link to rate (tc syntax: "10gbit", "100mbit") in
        both directions with a tbf qdisc on each end; replaces an earlier
        shape. burst defaults to 10 ms of traffic, at least 64 KiB."""
        if shutil.which("tc") is None:
            raise NetnsUnavailable("iproute2's tc is not installed")
        if burst is None:
            burst = str(max(int(tc_rate_bytes(rate) / 100), 64 * 1024))
        for ns, dev in self._ends(i):
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                  "rate", rate, "burst", burst, "latency", latency])

    def unshape(self, i: int) -> None:
        """Remove shape(i)'s qdiscs (none there is fine)."""
        for ns, dev in self._ends(i):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def qdiscs(self, i: int) -> str:
        """``tc qdisc show`` of both ends of host i's link."""
        return "".join(_run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout
                       for ns, dev in self._ends(i))


def tc_rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate: "10gbit" -> 1.25e9, "1mbps" -> 1e6."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate.strip().lower())
    if m is None:
        raise ValueError(f"cannot read tc rate {rate!r} (e.g. 10gbit, 100mbit, 1mbps)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale / (8 if m.group(3) == "bit" else 1)


# One ICMP echo, for `netns.py ping ADDRESS [TIMEOUT]` inside a namespace.

def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def icmp_echo(address: str, timeout: float = 5.0) -> float:
    """Send one echo request (raw socket, root) and wait for its reply."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, None, type=socket.SOCK_RAW)[0]
    v6 = family == socket.AF_INET6
    proto = socket.IPPROTO_ICMPV6 if v6 else socket.IPPROTO_ICMP
    request, reply = (128, 129) if v6 else (8, 0)
    ident = os.getpid() & 0xFFFF
    packet = struct.pack("!BBHHH", request, 0, 0, ident, 1) + b"trxh-ping"
    if not v6:  # the kernel fills in ICMPv6 checksums, not ICMPv4 ones
        packet = packet[:2] + struct.pack("!H", _checksum(packet)) + packet[4:]
    deadline = time.monotonic() + timeout
    with socket.socket(family, socket.SOCK_RAW, proto) as s:
        t0 = time.monotonic()
        s.sendto(packet, sockaddr)
        while True:
            s.settimeout(max(deadline - time.monotonic(), 0.001))
            data, _ = s.recvfrom(65536)
            if not v6:
                data = data[(data[0] & 0x0F) * 4:]  # past the IPv4 header
            kind, _, _, got_ident, _ = struct.unpack("!BBHHH", data[:8])
            if kind == reply and got_ident == ident:
                return time.monotonic() - t0


def main(argv: Sequence[str]) -> int:
    if len(argv) in (2, 3) and argv[0] == "ping":
        ipaddress.ip_address(argv[1].split("%")[0])  # numeric addresses only
        try:
            rtt = icmp_echo(argv[1], float(argv[2]) if len(argv) == 3 else 5.0)
        except (TimeoutError, OSError) as e:
            print(f"no reply from {argv[1]}: {e}", file=sys.stderr)
            return 1
        print(f"reply from {argv[1]} {rtt:.6f}")
        return 0
    print("usage: netns.py ping ADDRESS [TIMEOUT]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
