# SPDX-License-Identifier: BSD-3-Clause
"""Upstream's GENERIC_TESTS (every agent-agnostic RPC suite) on TORCH_RPC_EXT.

Plus TensorPipeAgentDistAutogradTest, and TensorPipeAgentRpcTest but for its
dynamic-group tests (elastic membership: a later issue; docs/conformance.md):
its options tests construct TensorPipeRpcBackendOptions and pass them to the
backend under test, which TORCH_RPC_EXT takes.
"""

import pytest
from torch.testing._internal.distributed.rpc import rpc_test
from torch.testing._internal.distributed.rpc_utils import (
    GENERIC_TESTS,
    TensorPipeAgentDistAutogradTest,
    generate_tests,
)

from tests.conformance.fixture import RpcExtAgentTestFixture

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(600)]


class TensorPipeAgentRpcTest(rpc_test.TensorPipeAgentRpcTest):
    """Upstream's TensorPipeAgentRpcTest without its test_dynamic_* tests."""


for _name in dir(rpc_test.TensorPipeAgentRpcTest):
    if _name.startswith("test_dynamic_"):
        setattr(TensorPipeAgentRpcTest, _name, None)
del _name

globals().update(
    generate_tests(
        "RpcExt",
        RpcExtAgentTestFixture,
        [*GENERIC_TESTS, TensorPipeAgentDistAutogradTest, TensorPipeAgentRpcTest],
        __name__,
    )
)
