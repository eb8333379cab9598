# SPDX-License-Identifier: BSD-3-Clause
"""Device maps at init: every worker's maps and devices are gathered and
checked with upstream's validator, so a bad map fails init on every worker
with TensorPipe's text and leaves no agent behind; a CPU-to-CPU map works;
and a group without device maps never asks torch about CUDA. (Moving CUDA
tensors needs a GPU: tests marked cuda, skipped here.)"""

import pytest
import torch
from torch.distributed import rpc

import torch_rpc_ext
from tests.rpc.world import free_port, run_world

pytestmark = pytest.mark.timeout(180)


def _options(port, **options):
    return torch_rpc_ext.RpcExtBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", address="127.0.0.1",
        num_worker_threads=4, **options)


def _init(rank, world_size, port, opts=None, **options):
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=opts or _options(port, **options),
    )


def _refused(rank, world_size, port, opts=None, **options):
    try:
        _init(rank, world_size, port, opts, **options)
    except ValueError as e:
        return type(e).__name__, str(e), rpc.api._is_current_rpc_agent_set()
    rpc.shutdown()
    return None


CASES = {
    # (worker0's map for worker1 / devices) -> upstream's first line
    "wrong_worker": (dict(device_maps={"none_exist": {0: 1}}),
                     "Node worker0 has invalid target node names in its device maps"),
    # A name no worker can have: upstream's words too (it read as a store
    # record no worker wrote, on every worker).
    "no_worker_name": (dict(device_maps={"trainer.0": {0: 1}}),
                       "Node worker0 has invalid target node names in its device maps"),
    "many_to_one": ("set_twice",
                    "Node worker0 has duplicated target devices in its device map for worker1"),
    "source_index": (dict(device_maps={"worker1": {0: 0}}),
                     "Node worker0 has source devices with invalid indices in its device map "
                     "for worker1"),
    "target_index": (dict(device_maps={"worker1": {"cpu": 0}}),
                     "Node worker0 has target devices with invalid indices in its device map "
                     "for worker1"),
    "devices": (dict(devices=["cuda:0"]), "Node worker0 has devices with invalid indices"),
}


def device_map_errors(rank, world_size, ports):
    out = {}
    for (label, (options, _)), port in zip(CASES.items(), ports):
        opts = _options(port, **(options if rank == 0 and options != "set_twice" else {}))
        if options == "set_twice" and rank == 0:
            # Two calls, each 1-to-1: only init's check of the merged map
            # sees two devices sent to one (as upstream).
            opts.set_device_map("worker1", {1: 0})
            opts.set_device_map("worker1", {0: 0})
        out[label] = _refused(rank, world_size, port, opts)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_bad_device_maps_fail_init_on_every_worker_with_upstreams_text():
    ports = [free_port() for _ in CASES]
    results = run_world(device_map_errors, ports=ports, timeout=150)
    for rank in (0, 1):
        for label, (_, text) in CASES.items():
            got = results[rank][label]
            assert got is not None, (rank, label)
            kind, message, agent_left = got
            assert kind == "ValueError" and message.startswith(text), (rank, label, message)
            assert not agent_left, (rank, label)


def cpu_map(rank, world_size, port):
    _init(rank, world_size, port, device_maps={f"worker{1 - rank}": {"cpu": "cpu"}})
    out = torch.equal(
        rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(2), 1)),
        torch.full((2,), 2.0),
    )
    rpc.shutdown()
    return out


def test_a_cpu_to_cpu_map_works():
    assert run_world(cpu_map, port=free_port()) == {0: True, 1: True}


def no_cuda_queries(rank, world_size, port):
    def boom(*args, **kwargs):
        raise AssertionError("init asked torch about CUDA")

    torch.cuda.device_count = boom
    torch.cuda.is_available = boom
    torch.cuda.init = boom
    _init(rank, world_size, port)
    out = rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), 1)).item()
    rpc.shutdown()
    return out


def test_a_group_without_device_maps_never_asks_about_cuda():
    assert run_world(no_cuda_queries, port=free_port()) == {0: 2.0, 1: 2.0}
