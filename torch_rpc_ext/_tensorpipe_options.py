# SPDX-License-Identifier: BSD-3-Clause
"""TensorPipe's options on TORCH_RPC_EXT: ``init_rpc(backend=TORCH_RPC_EXT,
rpc_backend_options=TensorPipeRpcBackendOptions(...))`` and the launcher both
translate them here, and report the settings that have no counterpart."""

import logging
import os
import sys
from typing import Any

from torch.distributed import rpc

from torch_rpc_ext.options import RpcExtBackendOptions

__all__ = ["remember_tensorpipe_only_settings", "translate_options", "note"]

# TensorPipe keeps these in C++ only (no getter): the options' constructor is
# wrapped to remember them, so they can be named when they are dropped.
_TENSORPIPE_ONLY = ("_transports", "_channels")
_REMEMBERED = "_torch_rpc_ext_tensorpipe_only"
_reported: set[str] = set()


def note(text: str, who: str = "torch_rpc_ext", worker: str = "") -> None:
    """One line on stderr, ``who: text``, unless ``TORCH_RPC_EXT_LOG`` is
    ``error`` or ``off`` (the core's switch for warnings); with
    ``TORCH_RPC_EXT_LOG_FORMAT=json`` or the lines routed to Python's logging
    (torch_rpc_ext.logs), a warning line of the core's, ``who: text`` as its
    message and ``worker`` (the worker it is about, if any) as its worker."""
    if os.environ.get("TORCH_RPC_EXT_LOG") in ("error", "off"):
        return
    from torch_rpc_ext import _C, logs

    if os.environ.get("TORCH_RPC_EXT_LOG_FORMAT") == "json" or logs.routed_to():
        # As the core's lines go: one JSON object, or a record of the logger.
        # Bytes: a name Python holds but UTF-8 cannot (a lone surrogate)
        # is escaped in the line rather than failing init_rpc.
        _C._log(
            logging.WARNING,
            worker.encode("utf-8", "surrogateescape"),
            f"{who}: {text}".encode("utf-8", "surrogateescape"),
        )
        return
    # One write per line: the workers a launcher starts share stderr, and
    # print() writes the text and its newline separately when stderr is
    # unbuffered (PYTHONUNBUFFERED=1, python -u), so two workers' notes
    # could be spliced into one line.
    sys.stderr.write(f"{who}: {text}\n")
    sys.stderr.flush()


def remember_tensorpipe_only_settings() -> None:
    """Make ``TensorPipeRpcBackendOptions`` keep its ``_transports`` and
    ``_channels`` arguments on the Python object. Nothing else changes: the
    same arguments reach TensorPipe's constructor, which checks them."""
    cls = rpc.TensorPipeRpcBackendOptions
    if getattr(cls.__init__, "_torch_rpc_ext_remembers", False):
        return
    original = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        given = {k: kwargs[k] for k in _TENSORPIPE_ONLY if kwargs.get(k) is not None}
        setattr(self, _REMEMBERED, given)

    __init__.__doc__ = original.__doc__
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__._torch_rpc_ext_remembers = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def translate_options(options: Any) -> RpcExtBackendOptions:
    """TensorPipe's (or torch's base) options as RpcExtBackendOptions.

    ``num_worker_threads``, ``rpc_timeout``, ``init_method``, ``device_maps``
    and ``devices`` carry over; ``_transports`` and ``_channels`` are reported
    once per process (per distinct value) on stderr as ignored. ``None`` gives
    the defaults; RpcExtBackendOptions are returned as they are.

    Raises:
        TypeError: ``options`` is not an ``rpc.RpcBackendOptions``.
    """
    if options is None:
        return RpcExtBackendOptions()
    if isinstance(options, RpcExtBackendOptions):
        return options
    if not isinstance(options, rpc.RpcBackendOptions):
        raise TypeError(
            "TORCH_RPC_EXT takes RpcExtBackendOptions or TensorPipeRpcBackendOptions, "
            f"got {type(options).__name__}"
        )
    kwargs: dict[str, Any] = {
        "rpc_timeout": options.rpc_timeout,
        "init_method": options.init_method,
    }
    if isinstance(options, rpc.TensorPipeRpcBackendOptions):
        kwargs["num_worker_threads"] = options.num_worker_threads
        kwargs["device_maps"] = dict(options.device_maps) or None
        kwargs["devices"] = list(options.devices) or None
        ignored = getattr(options, _REMEMBERED, {})
        text = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
        if ignored and text not in _reported:
            _reported.add(text)
            note(
                f"ignoring TensorPipe-only settings {text}: TORCH_RPC_EXT chooses "
                "its transports and channels per peer "
                "(RpcExtBackendOptions(transports=..., channels=...))"
            )
    return RpcExtBackendOptions(**kwargs)
