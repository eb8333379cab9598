# SPDX-License-Identifier: BSD-3-Clause
"""What ``python -m torch_rpc_ext.run`` changes in a launched program: its
``rpc.init_rpc`` selects TORCH_RPC_EXT where the program asked for TensorPipe
or for no backend, and says so on stderr. Nothing here runs unless the
launcher is used."""

from typing import Any

from torch.distributed import rpc
from torch.distributed.rpc import backend_registry

from torch_rpc_ext._tensorpipe_options import note, translate_options
from torch_rpc_ext.backend import BACKEND_NAME

__all__ = ["install"]


def _asked_for(backend: Any, options: Any) -> str:
    what = "no backend" if backend is None else f"BackendType.{backend.name}"
    if options is not None:
        what += f" with {type(options).__name__}"
    return what


def _takes(backend: Any, options: Any) -> bool:
    """Whether the launcher runs this init_rpc on TORCH_RPC_EXT: TensorPipe
    asked for, or no backend and options of TensorPipe's, ours, none, or
    the base class (upstream cannot infer a backend from that one, and
    raises; the launcher has always taken it). Another backend's options
    pick that backend, as upstream's init_rpc does."""
    if backend is not None:
        return getattr(backend, "name", None) == "TENSORPIPE"
    if options is None or type(options) is rpc.RpcBackendOptions:
        return True
    from torch_rpc_ext.options import RpcExtBackendOptions

    return isinstance(options, (rpc.TensorPipeRpcBackendOptions, RpcExtBackendOptions))


def install() -> None:
    """Make ``rpc.init_rpc`` select TORCH_RPC_EXT for TensorPipe or no
    backend (idempotent). Each switch is reported with one line on stderr:
    the worker, what the program asked for and what it got."""
    if getattr(rpc.init_rpc, "_torch_rpc_ext_launcher", False):
        return
    original = rpc.init_rpc

    def init_rpc(name, backend=None, rank=-1, world_size=None, rpc_backend_options=None):
        if _takes(backend, rpc_backend_options):
            asked = _asked_for(backend, rpc_backend_options)
            backend = backend_registry.BackendType[BACKEND_NAME]
            rpc_backend_options = translate_options(rpc_backend_options)
            note(
                f"worker {name!r} (rank {rank}) asked for {asked}; "
                f"runs BackendType.{BACKEND_NAME}",
                who="torch_rpc_ext.run",
                worker=name,
            )
        return original(name, backend, rank, world_size, rpc_backend_options)

    init_rpc.__doc__ = original.__doc__
    init_rpc._torch_rpc_ext_launcher = True  # type: ignore[attr-defined]
    rpc.init_rpc = init_rpc
