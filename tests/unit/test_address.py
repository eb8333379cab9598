# SPDX-License-Identifier: BSD-3-Clause
"""Which address the agent listens on and advertises."""

import pytest

from torch_rpc_ext import _C


def test_explicit_address_env_wins(monkeypatch):
    monkeypatch.setenv("TORCH_RPC_EXT_ADDR", "10.1.2.3")
    monkeypatch.setenv("TORCH_RPC_EXT_SOCKET_IFNAME", "lo")
    assert _C.default_address() == "10.1.2.3"


def test_interface_name_env_picks_that_interface(monkeypatch):
    monkeypatch.delenv("TORCH_RPC_EXT_ADDR", raising=False)
    monkeypatch.setenv("TORCH_RPC_EXT_SOCKET_IFNAME", "lo")
    assert _C.default_address() == "127.0.0.1"


def test_unknown_interface_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TORCH_RPC_EXT_ADDR", raising=False)
    monkeypatch.setenv("TORCH_RPC_EXT_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(ValueError, match="no-such-if0"):
        _C.default_address()


def test_default_is_an_ipv4_literal(monkeypatch):
    monkeypatch.delenv("TORCH_RPC_EXT_ADDR", raising=False)
    monkeypatch.delenv("TORCH_RPC_EXT_SOCKET_IFNAME", raising=False)
    parts = _C.default_address().split(".")
    assert len(parts) == 4 and all(0 <= int(p) <= 255 for p in parts)
