# SPDX-License-Identifier: BSD-3-Clause
"""RpcExtBackendOptions: defaults, validation with clear errors, no side effects."""

import pytest
import torch
from torch.distributed import rpc

from torch_rpc_ext import RpcExtBackendOptions


def test_defaults_match_upstream_constants(monkeypatch):
    monkeypatch.delenv("TORCH_RPC_EXT_TRANSPORTS", raising=False)
    opts = RpcExtBackendOptions()
    assert isinstance(opts, rpc.RpcBackendOptions)
    assert opts.rpc_timeout == rpc.constants.DEFAULT_RPC_TIMEOUT_SEC
    assert opts.init_method == rpc.constants.DEFAULT_INIT_METHOD
    assert opts.num_worker_threads == rpc.constants.DEFAULT_NUM_WORKER_THREADS
    assert opts.transports == ("shm", "tcp")
    assert opts.device_maps == {}
    assert opts.devices is None
    assert not opts.uses_cuda()


def test_base_fields_stay_writable():
    opts = RpcExtBackendOptions(rpc_timeout=5, init_method="tcp://127.0.0.1:1")
    opts.rpc_timeout = 7.5
    opts.init_method = "file:///tmp/x"
    assert (opts.rpc_timeout, opts.init_method) == (7.5, "file:///tmp/x")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_worker_threads": 0}, "num_worker_threads must be >= 1"),
        ({"num_worker_threads": 2.5}, "num_worker_threads must be an int"),
        ({"num_worker_threads": True}, "num_worker_threads must be an int"),
        ({"rpc_timeout": -1}, "rpc_timeout must be a number >= 0"),
        ({"transports": ()}, "transports must name at least one"),
        ({"transports": ("carrier-pigeon",)}, r"unknown transports \['carrier-pigeon'\]"),
        ({"transports": ("tcp", "tcp")}, "lists a transport twice"),
        ({"address": ""}, "address must be a non-empty str"),
        ({"secret": b"short"}, "secret must be at least 16 bytes"),
        ({"max_frame_bytes": 10}, "max_frame_bytes must be an int >= 1024"),
        ({"handshake_timeout": 0}, "handshake_timeout must be > 0"),
        ({"device_maps": {"w1": {"cuda": "cuda:0"}}}, "needs an index"),
        ({"device_maps": {"w1": {"tpu:0": "cpu"}}}, "not a device|only cpu and cuda"),
        ({"device_maps": {"w1": {"cuda:0": "cuda:0", "cuda:1": "cuda:0"}}}, "not 1-to-1"),
        ({"devices": ["banana"]}, "is not a device"),
    ],
)
def test_bad_options_are_rejected_with_the_reason(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RpcExtBackendOptions(**kwargs)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        RpcExtBackendOptions(4)  # type: ignore[misc]


def test_set_device_map_merges_and_refuses_remaps():
    opts = RpcExtBackendOptions()
    opts.set_device_map("w1", {0: 1})
    opts.set_device_map("w1", {"cuda:2": "cuda:3"})
    assert opts.device_maps["w1"] == {
        torch.device("cuda:0"): torch.device("cuda:1"),
        torch.device("cuda:2"): torch.device("cuda:3"),
    }
    assert opts.uses_cuda()
    with pytest.raises(ValueError, match="already mapped"):
        opts.set_device_map("w1", {0: 2})


def test_construction_does_not_touch_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("options touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setattr(torch.cuda, "device_count", boom)
    opts = RpcExtBackendOptions(device_maps={"w1": {"cuda:0": "cuda:1"}})
    assert opts.uses_cuda()


def test_secret_accepts_str_and_bytes():
    assert RpcExtBackendOptions(secret="x" * 16).secret == b"x" * 16
    assert RpcExtBackendOptions(secret=b"y" * 32).secret == b"y" * 32


def test_transports_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCH_RPC_EXT_TRANSPORTS", " tcp ")
    assert RpcExtBackendOptions().transports == ("tcp",)
    assert RpcExtBackendOptions(transports=["shm"]).transports == ("shm",)
    monkeypatch.setenv("TORCH_RPC_EXT_TRANSPORTS", "shm,ib")
    with pytest.raises(ValueError, match=r"unknown transports \['ib'\]"):
        RpcExtBackendOptions()
