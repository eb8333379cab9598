# SPDX-License-Identifier: BSD-3-Clause
"""What ``python -m torch_rpc_ext.run`` changes in a launched program: its
``rpc.init_rpc`` selects TORCH_RPC_EXT where the program asked for TensorPipe
or for no backend. Nothing here runs unless the launcher is used."""

import sys
from typing import Any

from torch.distributed import rpc
from torch.distributed.rpc import backend_registry

from torch_rpc_ext.backend import BACKEND_NAME
from torch_rpc_ext.options import RpcExtBackendOptions

__all__ = ["install", "translate_options"]

_reported: set[str] = set()


def translate_options(options: Any) -> RpcExtBackendOptions:
    """TensorPipe's (or torch's base) options as RpcExtBackendOptions:
    ``num_worker_threads``, ``rpc_timeout``, ``init_method``, ``device_maps``
    and ``devices`` carry over; TensorPipe-only settings are reported once
    (per process) as ignored."""
    if options is None:
        return RpcExtBackendOptions()
    if isinstance(options, RpcExtBackendOptions):
        return options
    kwargs = {"rpc_timeout": options.rpc_timeout, "init_method": options.init_method}
    if isinstance(options, rpc.TensorPipeRpcBackendOptions):
        kwargs["num_worker_threads"] = options.num_worker_threads
        kwargs["device_maps"] = dict(options.device_maps) or None
        kwargs["devices"] = list(options.devices) or None
        # torch keeps these in C++ only: install() records them at construction.
        ignored = getattr(options, "_torch_rpc_ext_ignored", {})
        text = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
        if ignored and text not in _reported:
            _reported.add(text)
            print(
                f"torch_rpc_ext.run: ignoring TensorPipe-only settings {text}: "
                "TORCH_RPC_EXT chooses its transports and channels per peer "
                "(RpcExtBackendOptions(transports=..., channels=...))",
                file=sys.stderr,
                flush=True,
            )
    return RpcExtBackendOptions(**kwargs)


def install() -> None:
    """Make ``rpc.init_rpc`` select TORCH_RPC_EXT for TensorPipe or no backend,
    and TensorPipe's options remember their TensorPipe-only settings."""
    if getattr(rpc.init_rpc, "_torch_rpc_ext_launcher", False):
        return
    options_cls = rpc.TensorPipeRpcBackendOptions
    options_init = options_cls.__init__

    def remembering_init(self, *args, _transports=None, _channels=None, **kwargs):
        options_init(self, *args, _transports=_transports, _channels=_channels, **kwargs)
        given = {"_transports": _transports, "_channels": _channels}
        self._torch_rpc_ext_ignored = {k: v for k, v in given.items() if v is not None}

    options_cls.__init__ = remembering_init
    original = rpc.init_rpc

    def init_rpc(name, backend=None, rank=-1, world_size=None, rpc_backend_options=None):
        if backend is None or getattr(backend, "name", None) == "TENSORPIPE":
            backend = backend_registry.BackendType[BACKEND_NAME]
            rpc_backend_options = translate_options(rpc_backend_options)
        return original(name, backend, rank, world_size, rpc_backend_options)

    init_rpc.__doc__ = original.__doc__
    init_rpc._torch_rpc_ext_launcher = True  # type: ignore[attr-defined]
    rpc.init_rpc = init_rpc
