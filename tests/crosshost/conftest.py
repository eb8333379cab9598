# SPDX-License-Identifier: BSD-3-Clause
"""Fixtures for tests across hosts made of network namespaces (netns.py).

``make_hosts(n)`` builds ``Hosts`` of n namespaces, removed at teardown;
``two_hosts`` is the common case. Both skip the test, with the reason, where
namespaces cannot be made (not root, no iproute2, a kernel or container that
forbids them)."""

import contextlib

import pytest

from tests.crosshost import netns


@pytest.fixture
def make_hosts():
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:

        def make(n=2, **kwargs):
            try:
                return stack.enter_context(netns.Hosts(n, **kwargs))
            except netns.NetnsUnavailable as e:
                pytest.skip(str(e))

        yield make


@pytest.fixture
def two_hosts(make_hosts):
    return make_hosts(2)
