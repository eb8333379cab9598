# SPDX-License-Identifier: BSD-3-Clause
"""Construct and init handlers of the TORCH_RPC_EXT backend; idempotent registration."""

import os
from typing import Any

import torch
from torch.distributed.rpc import constants

from torch_rpc_ext import _C, _torch_private
from torch_rpc_ext.options import RpcExtBackendOptions

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "TORCH_RPC_EXT"


def _construct_options(
    rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = constants.DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> RpcExtBackendOptions:
    return RpcExtBackendOptions(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def _agent_options(opts: RpcExtBackendOptions) -> "_C._RpcExtBackendOptionsBase":
    """What the agent takes: a copy of the core part of ``opts`` (which stays
    as given), with the secret from ``TORCH_RPC_EXT_SECRET`` if ``opts`` has none.
    """
    out = _C._RpcExtBackendOptionsBase(opts)
    if out.secret is None and (env := os.environ.get("TORCH_RPC_EXT_SECRET")):
        if len(env.encode()) < (least := _C.option_spec()["secret"][1]):
            raise ValueError(f"TORCH_RPC_EXT_SECRET must be at least {least} bytes")
        out.secret = env.encode()
    return out


def _init_backend(
    store: Any,
    name: str,
    rank: int,
    world_size: int | None,
    rpc_backend_options: RpcExtBackendOptions,
) -> Any:
    if not isinstance(rpc_backend_options, RpcExtBackendOptions):
        raise TypeError(
            f"TORCH_RPC_EXT needs RpcExtBackendOptions, got "
            f"{type(rpc_backend_options).__name__}"
        )
    if world_size is None:
        raise ValueError(
            "TORCH_RPC_EXT supports static groups only: pass world_size to init_rpc"
        )
    if rpc_backend_options.uses_cuda():
        if not torch.cuda.is_available():
            raise ValueError(
                "device_maps/devices name CUDA devices but CUDA is not available"
            )
        raise NotImplementedError(
            "TORCH_RPC_EXT does not move CUDA tensors yet; remove device_maps "
            "and devices, or use BackendType.TENSORPIPE for CUDA RPC"
        )
    agent = _C.Agent(store, name, rank, world_size, _agent_options(rpc_backend_options))
    try:
        _torch_private.init_rpc_states(agent)
    except Exception:
        agent.shutdown()
        raise
    return agent


def register() -> Any:
    """Register TORCH_RPC_EXT (once) and return its ``BackendType`` member."""
    return _torch_private.register_backend(
        BACKEND_NAME, _construct_options, _init_backend
    )
