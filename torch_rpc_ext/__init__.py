# SPDX-License-Identifier: BSD-3-Clause
"""torch_rpc_ext: a fast, authenticated backend for torch.distributed.rpc.

Importing this package registers ``rpc.BackendType.TORCH_RPC_EXT``::

    import torch.distributed.rpc as rpc
    import torch_rpc_ext

    rpc.init_rpc(
        "trainer", rank=0, world_size=2,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(num_worker_threads=8),
    )
"""

import atexit
import os

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed.rpc  # noqa: F401  (registers RpcAgent for _C)

__version__ = "0.1.0"  # setup.py VERSION

from torch_rpc_ext._torch_version import check_torch, load_error  # noqa: E402

check_torch()  # a clear ImportError, not an undefined symbol, for another torch
try:
    from torch_rpc_ext import _C
except ImportError as _e:
    if "undefined symbol" in str(_e):
        raise load_error(_e) from _e
    raise

from torch_rpc_ext import logs, scripting  # noqa: E402
from torch_rpc_ext._ports import free_port  # noqa: E402
from torch_rpc_ext._tensorpipe_options import (  # noqa: E402
    remember_tensorpipe_only_settings,
)
from torch_rpc_ext.backend import BACKEND_NAME, register  # noqa: E402
from torch_rpc_ext.elastic import (  # noqa: E402
    Member,
    MembershipEvent,
    membership,
    on_membership_change,
    remove_membership_callback,
)
from torch_rpc_ext.options import RpcExtBackendOptions  # noqa: E402

__all__ = [
    "BACKEND",
    "BACKEND_NAME",
    "Member",
    "MembershipEvent",
    "RpcExtBackendOptions",
    "free_port",
    "logs",
    "membership",
    "on_membership_change",
    "remove_membership_callback",
    "register",
    "scripting",
    "__version__",
]
register()
# TensorPipe's options keep their _transports/_channels on the Python object
# (nothing else about them changes), so that TORCH_RPC_EXT, given them, can
# name what it ignores.
remember_tensorpipe_only_settings()
# A program that ends with an agent still running (no rpc.shutdown()): our
# threads stop touching Python and torch before finalisation tears them down
# (csrc/common/exit_gate.h). Registered at import, so it runs after the
# program's own atexit handlers.
atexit.register(_C._close_exit_gate)
del _C
# The agent's log lines into Python's logging for a program not changed for
# it (torch_rpc_ext.logs); after the exit gate's hook, so it runs first.
if os.environ.get("TORCH_RPC_EXT_LOG_FORMAT") == "python":
    logs.to_python()


def __getattr__(name: str):
    # BACKEND is looked up on every access: any later register_backend()
    # (e.g. torch_rpc_ext.testing's FAULTY_TORCH_RPC_EXT) rebuilds torch's
    # BackendType enum, and a member kept from before would be stale.
    if name == "BACKEND":
        from torch.distributed.rpc import backend_registry

        return backend_registry.BackendType[BACKEND_NAME]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
