# SPDX-License-Identifier: BSD-3-Clause
"""Loaded at start-up by every Python process a launched program starts
(python -m torch_rpc_ext.run puts this folder first on PYTHONPATH).

With TORCH_RPC_EXT_LAUNCH=1 it installs the launcher's init_rpc; a process
that has torch but cannot install it exits with a message rather than run
TensorPipe among TORCH_RPC_EXT peers. A process without torch cannot start
RPC and is left alone. TORCH_RPC_EXT_LAUNCH=probe (the launcher's check that
this hook is in place) installs nothing. Then the sitecustomize this one
shadows, if any, runs.
"""

import os
import sys

TORCH_RPC_EXT_HOOK = True  # what the launcher's probe looks for

if os.environ.get("TORCH_RPC_EXT_LAUNCH") == "1":
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        try:
            from torch_rpc_ext import _launcher

            _launcher.install()
        except Exception as _e:  # noqa: BLE001  (any failure is fatal here)
            sys.stderr.write(
                f"torch_rpc_ext.run: cannot switch init_rpc to TORCH_RPC_EXT in "
                f"process {os.getpid()} ({sys.executable}): "
                f"{type(_e).__name__}: {_e}\n"
            )
            sys.stderr.flush()
            os._exit(1)

_here = os.path.dirname(os.path.abspath(__file__))
for _path in sys.path:
    _other = os.path.join(os.path.abspath(_path or "."), "sitecustomize.py")
    if os.path.dirname(_other) != _here and os.path.isfile(_other):
        with open(_other) as _f:
            exec(compile(_f.read(), _other, "exec"))
        break
