# SPDX-License-Identifier: BSD-3-Clause
"""torch_rpc_ext.free_port: a port no outgoing connection can take before the
store binds it."""

import socket

import torch_rpc_ext
from torch_rpc_ext import _ports


def test_the_port_is_below_the_ephemeral_range_and_free():
    low = _ports._ephemeral_low()
    for _ in range(20):
        port = torch_rpc_ext.free_port()
        assert 10_000 <= port < low, (port, low)  # connect() picks from [low, high]
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing kept it


def test_a_range_starting_too_low_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(_ports, "_ephemeral_low", lambda: 1024)
    port = torch_rpc_ext.free_port()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    assert low <= port <= high
