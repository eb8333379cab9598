# SPDX-License-Identifier: BSD-3-Clause
"""Registration: idempotent, and TensorPipe keeps working in the same process."""

import subprocess
import sys
import textwrap

import pytest
from torch.distributed import rpc

import torch_rpc_ext
from tests.rpc.world import free_port

pytestmark = pytest.mark.timeout(180)


def test_register_is_idempotent_and_public_enum_is_current():
    assert torch_rpc_ext.register() is torch_rpc_ext.BACKEND
    assert torch_rpc_ext.register() is rpc.BackendType.TORCH_RPC_EXT
    assert rpc.BackendType is rpc.backend_registry.BackendType
    assert {"TENSORPIPE", "TORCH_RPC_EXT"} <= set(rpc.BackendType.__members__)


def test_backend_stays_current_after_another_registration():
    # Registering any other backend rebuilds torch's BackendType enum.
    import torch_rpc_ext.testing

    assert torch_rpc_ext.BACKEND is rpc.BackendType.TORCH_RPC_EXT
    assert torch_rpc_ext.testing.register_faulty() is rpc.BackendType.FAULTY_TORCH_RPC_EXT
    assert {"TENSORPIPE", "TORCH_RPC_EXT", "FAULTY_TORCH_RPC_EXT"} <= set(rpc.BackendType.__members__)


def test_options_construction_handler_gives_our_options():
    opts = rpc.backend_registry.construct_rpc_backend_options(
        rpc.BackendType.TORCH_RPC_EXT, rpc_timeout=3, num_worker_threads=2
    )
    assert isinstance(opts, torch_rpc_ext.RpcExtBackendOptions)
    assert (opts.rpc_timeout, opts.num_worker_threads) == (3, 2)


SCRIPT = textwrap.dedent(
    """
    import os, torch
    import torch.distributed.rpc as rpc
    import torch_rpc_ext
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "{port}"

    def round_trip(**kwargs):
        rpc.init_rpc("solo", rank=0, world_size=1, **kwargs)
        agent = type(rpc.api._get_current_rpc_agent()).__name__
        out = rpc.rpc_sync("solo", torch.add, args=(torch.ones(1), 1)).item()
        rpc.shutdown()
        return agent, out

    print("default", *round_trip())
    print("explicit_tp", *round_trip(backend=rpc.BackendType.TENSORPIPE))
    print("tp_options", *round_trip(
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method="env://")))
    print("ours_explicit", *round_trip(backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(address="127.0.0.1")))
    print("ours_inferred", *round_trip(
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(address="127.0.0.1")))
    """
)


@pytest.mark.not_sanitized(
    "TensorPipe's agent runs here too: torch's uninstrumented loops and pipes read as races "
    "to TSan (seven of its functions in one run, none ours)", kinds=("thread",))
def test_tensorpipe_and_ours_side_by_side_in_one_process():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(port=free_port())],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    lines = dict(
        (line.split()[0], line.split()[1:]) for line in proc.stdout.splitlines()
    )
    assert lines["default"] == ["TensorPipeAgent", "2.0"]
    assert lines["explicit_tp"] == ["TensorPipeAgent", "2.0"]
    assert lines["tp_options"] == ["TensorPipeAgent", "2.0"]
    assert lines["ours_explicit"] == ["Agent", "2.0"]
    assert lines["ours_inferred"] == ["Agent", "2.0"]


def test_cuda_device_maps_are_refused_at_init_on_cpu_machines():
    script = textwrap.dedent(
        f"""
        import torch.distributed.rpc as rpc, torch_rpc_ext
        opts = torch_rpc_ext.RpcExtBackendOptions(
            init_method="tcp://127.0.0.1:{free_port()}",
            device_maps={{"solo": {{"cuda:0": "cuda:0"}}}})
        try:
            rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=opts)
        except (ValueError, NotImplementedError) as e:
            print(type(e).__name__, e)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    # Upstream's validator, as TensorPipe on a machine without GPUs.
    assert "ValueError Node solo has source devices with invalid indices" in proc.stdout
