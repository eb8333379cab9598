# SPDX-License-Identifier: BSD-3-Clause
"""Upstream's FAULTY_AGENT_TESTS on FAULTY_TORCH_RPC_EXT (torch_rpc_ext.testing).

FaultyAgentRpcTest, FaultyAgentDistAutogradTest and JitFaultyAgentRpcTest run
unmodified through RpcExtFaultyAgentTestFixture, which is upstream's
FaultyRpcAgentTestFixture with our backend, options and process start. Left
out: the two `test_verify_backend_options` tests, which assert that the
backend *is* FAULTY_TENSORPIPE (tests/rpc/test_fault_injection.py checks the
same options on ours).

This module runs in a pytest process of its own (tools/test.sh): importing
upstream's faulty fixture registers FAULTY_TENSORPIPE, whose options handler
takes no defaults, and from then on init_rpc's backend inference raises the
handler's TypeError instead of "Could not infer backend for options"
(RpcTest.test_cannot_infer_backend_from_options). Upstream keeps these suites
in separate test files for the same reason.
"""

import pytest
from torch.distributed import rpc
from torch.testing._internal.distributed.rpc.faulty_rpc_agent_test_fixture import (
    FaultyRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc_utils import (
    FAULTY_AGENT_TESTS,
    generate_tests,
)

import torch_rpc_ext.testing
from tests.conformance.fixture import ForkedOnRpcExt

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(600)]

TENSORPIPE_IDENTITY_TESTS = ("test_verify_backend_options",)


class RpcExtFaultyAgentTestFixture(ForkedOnRpcExt, FaultyRpcAgentTestFixture):
    @property
    def rpc_backend(self):
        return rpc.backend_registry.BackendType[torch_rpc_ext.testing.FAULTY_BACKEND_NAME]

    @property
    def rpc_backend_options(self):
        return rpc.backend_registry.construct_rpc_backend_options(
            self.rpc_backend,
            init_method=self.init_method,
            num_worker_threads=8,
            num_fail_sends=3,
            messages_to_fail=self.messages_to_fail,
            messages_to_delay=self.messages_to_delay,
        )


def _agent_agnostic(suite):
    return type(suite.__name__, (suite,), {n: None for n in TENSORPIPE_IDENTITY_TESTS})


globals().update(
    generate_tests(
        "RpcExt",
        RpcExtFaultyAgentTestFixture,
        [_agent_agnostic(s) for s in FAULTY_AGENT_TESTS],
        __name__,
    )
)
