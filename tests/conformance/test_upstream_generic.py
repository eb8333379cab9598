# SPDX-License-Identifier: BSD-3-Clause
"""Upstream's GENERIC_TESTS (every agent-agnostic RPC suite) on TORCH_RPC_EXT.

Plus TensorPipeAgentDistAutogradTest and TensorPipeAgentRpcTest, whole: its
options tests construct TensorPipeRpcBackendOptions and pass them to the
backend under test, which TORCH_RPC_EXT takes; its dynamic-group tests join
and leave a group with world_size=None (docs/elastic.md).
"""

import pytest
from torch.testing._internal.distributed.rpc_utils import (
    GENERIC_TESTS,
    TensorPipeAgentDistAutogradTest,
    TensorPipeAgentRpcTest,
    generate_tests,
)

from tests.conformance.fixture import RpcExtAgentTestFixture

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(600)]


globals().update(
    generate_tests(
        "RpcExt",
        RpcExtAgentTestFixture,
        [*GENERIC_TESTS, TensorPipeAgentDistAutogradTest, TensorPipeAgentRpcTest],
        __name__,
    )
)
