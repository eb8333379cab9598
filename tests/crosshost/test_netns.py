# SPDX-License-Identifier: BSD-3-Clause
"""Self-test of the namespace hosts (netns.py) that the cross-host tests
stand on: hosts reach each other by IPv4, IPv6 ULA and IPv6 link-local
through the bridge, a cut link partitions and heals, tbf shaping is applied
and really slows a transfer, and nothing is left behind, not even after an
exception inside the ``with`` block. Needs root and iproute2; skips
otherwise."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.crosshost import netns

pytestmark = pytest.mark.timeout(180)


def test_hosts_reach_each_other_over_ipv4_ula_and_link_local(make_hosts):
    hosts = make_hosts(3)  # three, so that the bridge (not a veth pair) is what joins them
    assert [hosts.ipv4(i) for i in range(3)] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    assert [hosts.ipv6(i) for i in range(3)] == ["fd00:213::1", "fd00:213::2", "fd00:213::3"]
    ll = hosts.link_local(1, via=0)
    assert ll.startswith("fe80::") and ll.endswith(f"%{hosts.ifname(0)}"), ll
    for src, dst in [(0, 1), (1, 0), (2, 0)]:
        hosts.ping(src, hosts.ipv4(dst))
        hosts.ping(src, hosts.ipv6(dst))
        hosts.ping(src, hosts.link_local(dst, via=src))
    hosts.ping(0, "127.0.0.1")  # lo is up
    # Each host is its own network stack: the caller's namespace has none of
    # these addresses.
    assert "10.213.0.1" not in subprocess.run(["ip", "-o", "addr"], capture_output=True,
                                              text=True, timeout=30).stdout


def test_link_down_partitions_a_host_and_link_up_heals_it(two_hosts):
    hosts = two_hosts
    hosts.ping(0, hosts.ipv4(1))
    hosts.link_down(1)
    with pytest.raises(subprocess.CalledProcessError):
        hosts.ping(0, hosts.ipv4(1), timeout=1)
    with pytest.raises(subprocess.CalledProcessError):
        hosts.ping(0, hosts.ipv6(1), timeout=1)
    # Host 1 keeps its addresses while cut off.
    assert hosts.ipv6(1) in hosts.execute(1, ["ip", "-6", "addr"]).stdout
    hosts.link_up(1)
    deadline = time.monotonic() + 10
    while True:  # the carrier comes back within milliseconds; allow a busy machine more
        try:
            hosts.ping(0, hosts.ipv4(1), timeout=1)
            hosts.ping(0, hosts.ipv6(1), timeout=1)
            break
        except subprocess.CalledProcessError:
            if time.monotonic() > deadline:
                raise


# Sends N bytes to host 1 and prints the seconds until host 1 has them all.
RECEIVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", 29611))
print("LISTENING", flush=True)
c, _ = s.accept()
n = 0
while n < int(sys.argv[1]):
    n += len(c.recv(1 << 20))
c.sendall(b"k")
"""
SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 29611), timeout=60)
data = bytes(int(sys.argv[2]))
t0 = time.monotonic()
c.sendall(data)
assert c.recv(1) == b"k"
print(time.monotonic() - t0)
"""


def transfer_seconds(hosts, nbytes):
    receiver = hosts.run(1, [sys.executable, "-c", RECEIVER, str(nbytes)], timeout=120,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "LISTENING"
        r = hosts.execute(0, [sys.executable, "-c", SENDER, hosts.ipv4(1), str(nbytes)],
                          timeout=120)
        receiver.wait(timeout=60)
        return float(r.stdout)
    finally:
        receiver.kill()
        receiver.wait()


def test_tbf_shaping_applies_and_is_removed(two_hosts):
    hosts = two_hosts
    hosts.shape(0, "10gbit")
    shown = hosts.qdiscs(0)
    assert shown.count("qdisc tbf") == 2 and "rate 10Gbit" in shown, shown
    # At 20 Mbit/s (2.5 MB/s) 2.5 MB take about a second; unshaped, a veth
    # carries them in milliseconds.
    hosts.shape(0, "20mbit")
    assert "rate 20Mbit" in hosts.qdiscs(0)
    assert transfer_seconds(hosts, 2_500_000) > 0.6
    hosts.unshape(0)
    assert "tbf" not in hosts.qdiscs(0)
    hosts.unshape(0)  # nothing to remove: not an error
    assert netns.tc_rate_bytes("10gbit") == 1.25e9
    assert netns.tc_rate_bytes("1mbps") == 1e6


def test_nothing_is_left_after_an_exception():
    if netns.unavailable_reason():
        pytest.skip(netns.unavailable_reason())
    try:
        with netns.Hosts(2) as hosts:
            prefix = hosts.prefix
            sleeper = hosts.run(1, ["sleep", "600"])
            assert netns.leftovers(prefix)  # the namespaces exist meanwhile
            raise KeyError("boom")
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))
    except KeyError:
        pass
    assert sleeper.poll() is not None  # killed, not orphaned
    assert netns.leftovers(prefix) == []


# What a program run by Hosts.run sees (forkserver.py): its namespace's
# interfaces, its argv, directory, environment and file descriptors, its
# stdin; whether torch was imported before it started. Then it ends as told.
PROGRAM = """
import json, os, signal, socket, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "x": os.environ.get("TRXH_X"),
                  "ifs": sorted(n for _, n in socket.if_nameindex()), "pid": os.getpid(),
                  "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
                  "preloaded": "torch" in sys.modules, "main": __name__}), flush=True)
line = sys.stdin.readline().strip()
if line == "sleep":
    time.sleep(600)
if line == "usr1":
    os.kill(os.getpid(), signal.SIGUSR1)
sys.exit(int(line))
"""


def _program(hosts, tmp_path, env, then=None):
    p = hosts.run(1, [sys.executable, "-c", PROGRAM, "a", "b"], timeout=120, text=True,
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tmp_path,
                  env={**env, "TRXH_X": "y"})
    seen = json.loads(p.stdout.readline())
    if then is not None:
        p.stdin.write(then + "\n")
        p.stdin.flush()
    return p, seen


def _gone(pid, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_python_programs_run_forked_inside_their_host_as_if_started_there(two_hosts, tmp_path):
    hosts = two_hosts
    env = {k: v for k, v in os.environ.items() if k != "TORCH_RPC_EXT_TEST_START"}
    p, seen = _program(hosts, tmp_path, env, then="3")
    assert seen == {"argv": ["a", "b"], "cwd": str(tmp_path), "x": "y",
                    "ifs": sorted(["lo", hosts.ifname(1)]), "pid": seen["pid"],
                    "fds": [0, 1, 2, 3], "preloaded": True, "main": "__main__"}, seen
    assert p.wait(timeout=30) == 3  # its exit code, through the client, timeout and ip
    # A signal to the process the test started reaches the program (timeout
    # passes it on to the client, the client to the program), which handles it.
    p, seen = _program(hosts, tmp_path, env, then="sleep")
    p.terminate()
    assert p.wait(timeout=30) == 7
    # A program killed by a signal: so is what the test started.
    p, seen = _program(hosts, tmp_path, env, then="usr1")
    assert p.wait(timeout=30) in (-signal.SIGUSR1, 128 + signal.SIGUSR1)
    # A client killed outright (Hosts.close, timeout --kill-after) takes it along.
    p, seen = _program(hosts, tmp_path, env)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert _gone(seen["pid"])
    # -m, stdin to stdout.
    p = hosts.run(0, [sys.executable, "-m", "json.tool", "--compact"], timeout=60, text=True,
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert p.communicate('{"a": [1, 2]}', timeout=30)[0] == '{"a":[1,2]}\n'
    # TORCH_RPC_EXT_TEST_START=spawn: a fresh interpreter, as before.
    p, seen = _program(hosts, tmp_path, {**env, "TORCH_RPC_EXT_TEST_START": "spawn"}, then="0")
    assert not seen["preloaded"] and seen["ifs"] == sorted(["lo", hosts.ifname(1)]), seen
    assert p.wait(timeout=30) == 0
