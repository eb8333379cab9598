# SPDX-License-Identifier: BSD-3-Clause
"""Loaded at start-up by every Python process a launched program starts
(python -m torch_rpc_ext.run puts this folder first on PYTHONPATH).

With TORCH_RPC_EXT_LAUNCH=1 it installs the launcher's init_rpc once the
process imports torch, not at start-up: a program may set what torch reads
at import (OMP_NUM_THREADS, TORCH_LOGS) before it imports torch, and a
Python the program starts that never imports torch pays nothing. A process
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


def _install() -> None:
    try:
        from torch_rpc_ext import _launcher

        _launcher.install()
    except Exception as e:  # noqa: BLE001  (whatever failed, say it at init_rpc)
        _refuse_rpc(e)


class _LoaderThenInstall:
    """torch's own loader; once it has run (torch imported whole), the
    launcher's init_rpc is installed."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        # The module keeps its own loader (inspect, importlib.resources).
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        _install()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _WhenTorchLoads:
    """A finder for one import, torch's: the spec the other finders give,
    its loader wrapped."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThenInstall(spec.loader)
        return spec


if os.environ.get("TORCH_RPC_EXT_LAUNCH") == "1":
    if "torch" in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _WhenTorchLoads())
_chain()
