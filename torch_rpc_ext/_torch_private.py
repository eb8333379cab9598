# SPDX-License-Identifier: BSD-3-Clause
"""Every private torch.distributed.rpc touchpoint, so a torch upgrade edits one file."""

from collections.abc import Callable
from typing import Any

import torch.distributed.rpc as rpc
from torch.distributed.rpc import api, backend_registry

__all__ = [
    "register_backend",
    "init_rpc_states",
    "validate_device_maps",
    "register_ordered_effect",
    "unset_fake_mode",
]


def register_backend(
    name: str, construct_options: Callable[..., Any], init_backend: Callable[..., Any]
) -> Any:
    """Register ``name`` once and return its ``BackendType`` member.

    ``register_backend`` replaces ``backend_registry.BackendType`` with a new
    enum, while ``torch.distributed.rpc.BackendType`` still points at the old
    one, which breaks ``init_rpc`` for every backend (TensorPipe included).
    Re-pointing the public name repairs default init, explicit
    ``BackendType.TENSORPIPE`` and inference from options.
    """
    if not backend_registry.backend_registered(name):
        backend_registry.register_backend(name, construct_options, init_backend)
    rpc.BackendType = backend_registry.BackendType
    return backend_registry.BackendType[name]


def init_rpc_states(agent: Any) -> None:
    """Publish the agent's worker names and make it the current, started agent."""
    api._init_rpc_states(agent)


def validate_device_maps(
    names: list[str],
    counts: dict[str, int],
    device_maps: dict[str, dict],
    devices: dict[str, list],
    my_name: str,
) -> tuple[dict, list]:
    """Upstream's checks of every worker's device maps and devices, with its
    error texts (``ValueError("Node worker0 has ...")``), then this worker's
    reverse maps (peer -> {its device: ours}) and its device list, as
    TensorPipe computes them at init."""
    backend_registry._validate_device_maps(names, counts, device_maps, devices)
    reverse = backend_registry._create_reverse_mapping(my_name, names, device_maps)
    mine = backend_registry._create_device_list(devices[my_name], device_maps[my_name], reverse)
    return reverse, mine


def register_ordered_effect(qualname: str) -> None:
    """Mark an operator as an ordered side effect for torch.compile: AOT
    autograd threads a token through every call, so a call whose value is
    unused is not eliminated and calls keep their program order."""
    import torch
    from torch._library.effects import EffectType

    torch.library._register_effectful_op(qualname, EffectType.ORDERED)


def unset_fake_mode() -> Any:
    """A context in which tensors are real again (inside a fake impl)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()
