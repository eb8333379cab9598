# SPDX-License-Identifier: BSD-3-Clause
"""Our RpcAgentTestFixture: upstream's agent-agnostic suites run unmodified on it."""

import glob
import os
import warnings

import torch.multiprocessing
from torch.distributed import rpc
from torch.testing._internal import common_distributed
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


# The DDP suites can hang in torch itself, on any agent (docs/conformance.md,
# "DDP + gloo teardown deadlock"): a C++ destructor joins gloo's worker
# threads while holding the GIL that one of them needs (pytorch#56297).
# Measured before the fix below: 1 run in 5 of test_ddp_comparison hung on
# our agent, 1 in 62 on TensorPipe; CI failed on three hangs in a row. The
# fix: the child keeps the groups the body destroys (_keep_destroyed_
# process_groups). What is left as a safety net: those tests take about a
# second, so a hang is cut at 30 s and the test is run again on fresh
# processes, with a warning in pytest's summary saying so, up to _ATTEMPTS
# runs in all. A test that hangs every time fails.
_UPSTREAM_DEADLOCK_SUITES = ("DdpUnderDistAutogradTest", "DdpComparisonTest")
_HANG_LIMIT_S = 30
_ATTEMPTS = 3

# Their bodies also race: the master's first RPC can reach a trainer before
# the trainer's own init_process_group has set its default group. torch's
# own switch for an end-of-init barrier orders the two.
os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")


# What the fixture does about the deadlock in those suites' child processes
# (docs/conformance.md): the process groups a test body destroys are kept
# referenced until the process ends, so the last reference is never dropped
# by a destructor the test body runs with the GIL held (DDP's Reducer, when
# the body's frame is cleared). ~ProcessGroupGloo then never runs: the
# child leaves through os._exit. Nothing of RPC changes; destroy_process_group
# itself still runs, unchanged.
_kept_process_groups: list = []


def _keep_destroyed_process_groups() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group

    def destroy_process_group(group=None):
        if group is None or group is c10d.GroupMember.WORLD:
            _kept_process_groups.extend(c10d._world.pg_map.keys())
        else:
            _kept_process_groups.append(group)
        return original(group)

    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def _deadlock_prone(test) -> bool:
    return any(
        base.__name__ in _UPSTREAM_DEADLOCK_SUITES for base in type(test).__mro__
    )


class ForkedOnRpcExt:
    """What every fixture of ours shares: processes forked, our error texts."""

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

    def tearDown(self) -> None:
        super().tearDown()
        # Upstream's MultiProcessTestCase leaves its rendezvous file in the
        # temporary directory, and the bodies' FileStores beside it (the
        # name with "_pg" or "init_2" added): some 9,000 files after a day
        # of runs. The name comes from NamedTemporaryFile, so what begins
        # with it is this test's.
        for path in glob.glob(glob.escape(self.file_name) + "*"):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


class RpcExtAgentTestFixture(ForkedOnRpcExt, RpcAgentTestFixture):
    @property
    def rpc_backend(self):
        return rpc.backend_registry.BackendType[_BACKEND]

    @property
    def rpc_backend_options(self):
        return rpc.backend_registry.construct_rpc_backend_options(
            self.rpc_backend, init_method=self.init_method
        )

    def run_test(self, test_name: str, parent_pipe) -> None:
        # In the child process, before the test body runs.
        if _deadlock_prone(self):
            _keep_destroyed_process_groups()
        super().run_test(test_name, parent_pipe)

    def _join_processes(self, fn) -> None:
        if not _deadlock_prone(self):
            return super()._join_processes(fn)
        name = self.id().split(".")[-1]
        common_distributed.TIMEOUT_OVERRIDE.setdefault(name, _HANG_LIMIT_S)
        for attempt in range(1, _ATTEMPTS):
            try:
                return super()._join_processes(fn)
            except RuntimeError as e:
                if "terminated or timed out" not in str(e):
                    raise
            warnings.warn(
                f"{self.id()} hung (torch's DDP/gloo teardown deadlock, "
                f"pytorch#56297) on run {attempt} of at most {_ATTEMPTS}; "
                "running it again on fresh processes",
                stacklevel=1,
            )
            self.tearDown()
            self.setUp()
        return super()._join_processes(fn)
