# SPDX-License-Identifier: BSD-3-Clause
"""A network partition between two hosts, simulated with two network
namespaces joined by a veth pair: once the link is cut, the pending call
fails within about heartbeat_timeout, naming the peer (not at rpc_timeout,
60 s). Needs root and iproute2; skips cleanly otherwise."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("partition_worker.py")
pytestmark = pytest.mark.timeout(180)


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = f"trpx{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    if _ip("netns", "add", a, check=False).returncode != 0:
        pytest.skip("cannot create network namespaces here")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y")
        _ip("link", "set", f"{tag}x", "netns", a)
        _ip("link", "set", f"{tag}y", "netns", b)
        for ns, dev, addr in [(a, f"{tag}x", "10.231.7.1/24"), (b, f"{tag}y", "10.231.7.2/24")]:
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, f"{tag}x"
    finally:
        _ip("netns", "del", a, check=False)
        _ip("netns", "del", b, check=False)


def test_cut_link_fails_pending_call_via_heartbeat(two_hosts):
    a, b, link = two_hosts
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = "29733"
    cmd = lambda ns, rank, me: [  # noqa: E731
        "ip", "netns", "exec", ns, sys.executable, str(WORKER), str(rank), "10.231.7.1", port, me]
    w0 = subprocess.Popen(cmd(a, 0, "10.231.7.1"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, env=env, cwd=ROOT)
    w1 = subprocess.Popen(cmd(b, 1, "10.231.7.2"), stdout=subprocess.DEVNULL, env=env, cwd=ROOT)
    try:
        assert w0.stdout.readline().strip() == "READY"
        _ip("-n", a, "link", "set", link, "down")  # the partition
        w0.stdin.write("CUT\n")
        w0.stdin.flush()
        out = json.loads(w0.stdout.readline())
        w0.wait(timeout=30)
    finally:
        for p in (w0, w1):
            p.kill()
            p.wait()
    assert out["before_cut_ok"]
    assert out["error"] is not None and "worker1" in out["error"], out
    assert "heartbeat" in out["error"], out
    # heartbeat_timeout is 2 s: ~2-2.4 s on a quiet host; a starved process
    # or a busy host gives the peer more time, up to 6 timeouts in all
    # (connection.cpp, kMaxHandshakeTimeouts), and that cap is what is
    # checked against: rpc_timeout is 60 s.
    assert out["detect_s"] < 6 * 2 + 3, out
