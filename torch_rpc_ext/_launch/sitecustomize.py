# SPDX-License-Identifier: BSD-3-Clause
"""Loaded at start-up by every Python process a launched program starts
(python -m torch_rpc_ext.run puts this folder first on PYTHONPATH).

With TORCH_RPC_EXT_LAUNCH=1 it installs the launcher's init_rpc. A process
that has torch but cannot load torch_rpc_ext (a broken install, another
environment's Python) keeps running, but its init_rpc raises, naming the
cause, rather than start TensorPipe among TORCH_RPC_EXT peers; a process
without torch cannot start RPC and is left alone. TORCH_RPC_EXT_LAUNCH=probe
(the launcher's check that this hook is in place) installs nothing. Then the
sitecustomize this one shadows, if any, runs.
"""

import os
import sys

TORCH_RPC_EXT_HOOK = True  # what the launcher's probe looks for


def _refuse_rpc(error: BaseException) -> None:
    try:
        from torch.distributed import rpc
    except Exception:  # noqa: BLE001  (no torch here: no RPC to refuse)
        return
    text = (
        f"torch_rpc_ext.run: cannot switch init_rpc to TORCH_RPC_EXT in process "
        f"{os.getpid()} ({sys.executable}): {type(error).__name__}: {error}; "
        "refusing to start TensorPipe among TORCH_RPC_EXT peers"
    )

    def init_rpc(*args, **kwargs):
        raise RuntimeError(text)

    rpc.init_rpc = init_rpc


def _chain() -> None:
    """Run the first other sitecustomize on sys.path, as Python would have."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    for path in sys.path:
        other = os.path.join(os.path.abspath(path or "."), "sitecustomize.py")
        if os.path.realpath(os.path.dirname(other)) != here and os.path.isfile(other):
            with open(other) as f:
                code = compile(f.read(), other, "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": other})
            return


if os.environ.get("TORCH_RPC_EXT_LAUNCH") == "1":
    try:
        from torch_rpc_ext import _launcher

        _launcher.install()
    except Exception as _e:  # noqa: BLE001  (whatever failed, say it at init_rpc)
        _refuse_rpc(_e)
_chain()
