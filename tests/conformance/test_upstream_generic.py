# SPDX-License-Identifier: BSD-3-Clause
"""Upstream's GENERIC_TESTS (every agent-agnostic RPC suite) on TORCH_RPC_EXT.

Plus TensorPipeAgentDistAutogradTest and the sparse-tensor tests of
TensorPipeAgentRpcTest, which are agent-agnostic in substance.
"""

import pytest
from torch.testing._internal.distributed.rpc.rpc_test import TensorPipeAgentRpcTest
from torch.testing._internal.distributed.rpc_utils import (
    GENERIC_TESTS,
    TensorPipeAgentDistAutogradTest,
    generate_tests,
)

from tests.conformance.fixture import RpcExtAgentTestFixture

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(600)]


class SparseRpcTest(TensorPipeAgentRpcTest):
    """TensorPipeAgentRpcTest reduced to its *_sparse tests."""


for _name in dir(TensorPipeAgentRpcTest):
    if _name.startswith("test_") and not _name.endswith("_sparse"):
        setattr(SparseRpcTest, _name, None)
del _name

globals().update(
    generate_tests(
        "RpcExt",
        RpcExtAgentTestFixture,
        [*GENERIC_TESTS, TensorPipeAgentDistAutogradTest, SparseRpcTest],
        __name__,
    )
)
