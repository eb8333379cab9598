# SPDX-License-Identifier: BSD-3-Clause
"""Every private torch.distributed.rpc touchpoint, so a torch upgrade edits one file."""

from collections.abc import Callable
from typing import Any

import torch.distributed.rpc as rpc
from torch.distributed.rpc import api, backend_registry

__all__ = ["register_backend", "init_rpc_states"]


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
