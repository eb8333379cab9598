# SPDX-License-Identifier: BSD-3-Clause
"""Our RpcAgentTestFixture: upstream's agent-agnostic suites run unmodified on it."""

import os

import torch.multiprocessing
from torch.distributed import rpc
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (
    RpcAgentTestFixture,
)

import torch_rpc_ext

# Errors a call may see when its peer shuts down or dies under it.
SHUTDOWN_ERRORS = [
    "RPC agent is shutting down",
    "shut down before a response arrived",
    "connection .* lost",
    "connection .* is closed",
    "peer closed the connection",
    "Connection reset by peer",
    "Broken pipe",
    "connect to .* failed",
    "RPC is no longer running on this node",
]


# TORCH_RPC_EXT_CONFORMANCE_BACKEND=TENSORPIPE runs the same suites, through the
# same fork fixture, on torch's TensorPipe agent: the control group for flakes
# that may be upstream's (docs/conformance.md).
_BACKEND = os.environ.get("TORCH_RPC_EXT_CONFORMANCE_BACKEND", torch_rpc_ext.BACKEND_NAME)


class RpcExtAgentTestFixture(RpcAgentTestFixture):
    @property
    def rpc_backend(self):
        return rpc.backend_registry.BackendType[_BACKEND]

    @property
    def rpc_backend_options(self):
        return rpc.backend_registry.construct_rpc_backend_options(
            self.rpc_backend, init_method=self.init_method
        )

    def get_shutdown_error_regex(self):
        return "|".join(f"({e})" for e in SHUTDOWN_ERRORS)

    def get_timeout_error_regex(self):
        return "RPC ran for more than"

    def _spawn_processes(self) -> None:
        # Fork from the pytest process, which has torch and torch_rpc_ext
        # imported already: a spawned child spends seconds re-importing
        # torch, and 4 of them per test is what makes the suites slow on two
        # cores. The test bodies are upstream's, unchanged.
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

