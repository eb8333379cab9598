# SPDX-License-Identifier: BSD-3-Clause
"""Loaded at start-up by every Python process a launched program starts
(python -m torch_rpc_ext.run puts this folder first on PYTHONPATH): with
TORCH_RPC_EXT_LAUNCH=1, install the launcher's init_rpc, then run the
sitecustomize this one shadows, if any."""

import os
import sys

if os.environ.get("TORCH_RPC_EXT_LAUNCH") == "1":
    from torch_rpc_ext import _launcher

    _launcher.install()

_here = os.path.dirname(os.path.abspath(__file__))
for _path in sys.path:
    _other = os.path.join(os.path.abspath(_path or "."), "sitecustomize.py")
    if os.path.dirname(_other) != _here and os.path.isfile(_other):
        with open(_other) as _f:
            exec(compile(_f.read(), _other, "exec"))
        break
