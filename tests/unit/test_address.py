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


def test_a_link_local_address_keeps_its_scope():
    """Advertised with its interface (TensorPipe loses the scope, so a
    link-local address cannot be dialled); written back as it was parsed."""
    from torch_rpc_ext import _testing

    # lo is interface 1 everywhere; any link-local address parses with it.
    assert _testing.route_from("fe80::1%lo", "[fe80::2%lo]:5") == "[fe80::2%lo]:5"


def test_a_link_local_peer_is_reached_through_our_own_interface():
    """The scope a peer advertises names its interface, which this host may
    not have: ours (the one we listen on) takes its place."""
    from torch_rpc_ext import _testing

    assert _testing.route_from("fe80::1%lo", "[fe80::2%eth-of-peer]:5") == "[fe80::2%lo]:5"
    assert _testing.route_from("fe80::1%1", "[fe80::2]:5") == "[fe80::2%lo]:5"
    with pytest.raises(ValueError, match="link-local address .* is reachable only over its link"):
        _testing.route_from("fd00::1", "[fe80::2%eth0]:5")


@pytest.mark.parametrize(
    "self_address, peer",
    [("10.0.0.1", "[fd00::2]:5"), ("fd00::1", "10.0.0.2:5"), ("fe80::1%lo", "10.0.0.2:5")],
)
def test_a_group_of_mixed_families_fails_naming_both(self_address, peer):
    from torch_rpc_ext import _testing

    with pytest.raises(ValueError, match="every worker of a group must listen on addresses of one family"):
        _testing.route_from(self_address, peer)
    assert _testing.route_from("10.0.0.1", "10.0.0.2:5") == "10.0.0.2:5"
    assert _testing.route_from("fd00::1", "[fd00::2]:5") == "[fd00::2]:5"


@pytest.mark.parametrize("peer", ["fe80::2%eth0:5", "[fe80::2]:5%eth0"])
def test_a_scope_outside_the_brackets_is_refused_saying_where_it_goes(peer):
    from torch_rpc_ext import _testing

    with pytest.raises(ValueError, match=r"an IPv6 scope goes inside the brackets"):
        _testing.route_from("fe80::1%lo", peer)
