# SPDX-License-Identifier: BSD-3-Clause
"""Upstream's CUDA RPC suites (GENERIC_CUDA_TESTS + TENSORPIPE_CUDA_TESTS) on
TORCH_RPC_EXT, unmodified, through a spawn-based fixture (CUDA cannot be used
after fork). They need a GPU: without one the whole module is skipped here
(each test would otherwise spawn its four processes only to skip);
tools/gpu_check.sh runs it on a GPU machine, where the tests that need more
GPUs than it has are skipped before they spawn anything (gpus.py). docs/cuda.md says what passed
there and when.
"""

import pytest
import torch
from torch.testing._internal.distributed.rpc_utils import (
    GENERIC_CUDA_TESTS,
    TENSORPIPE_CUDA_TESTS,
    generate_tests,
)

from tests.conformance.fixture import RpcExtAgentTestFixture
from tests.conformance_cuda.gpus import skip_beyond

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.conformance,
    pytest.mark.timeout(600),
    pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU"),
]


class RpcExtSpawnedAgentTestFixture(RpcExtAgentTestFixture):
    """Our fixture with spawned processes, as upstream runs its CUDA suites."""

    def _spawn_processes(self) -> None:
        self._start_processes(torch.multiprocessing.get_context("spawn").Process)


_generated = generate_tests(
    "RpcExt",
    RpcExtSpawnedAgentTestFixture,
    [*GENERIC_CUDA_TESTS, *TENSORPIPE_CUDA_TESTS],
    __name__,
)
# The tests that need more GPUs than this machine has skip here, with
# upstream's reason, instead of after spawning their processes (57 of the 99
# on one GPU): tests/conformance_cuda/gpus.py.
skip_beyond(_generated.values(), torch.cuda.device_count())
globals().update(_generated)
