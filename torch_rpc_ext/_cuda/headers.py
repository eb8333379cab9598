# SPDX-License-Identifier: BSD-3-Clause
"""Where cuda.h is, for building: the extension (setup.py loads this file by
path, before the package exists) and the fake driver of the tests.

Only the header is needed: the extension resolves the driver at run time
(csrc/common/libcuda.h). It comes from NVIDIA's ``nvidia-cuda-runtime``
wheel (``nvidia/cu13/include``, or ``nvidia/cuda_runtime/include`` for CUDA
12) or from ``$CUDA_HOME/include``.
"""

import importlib.util
import os
from pathlib import Path

__all__ = ["HOW_TO_GET", "cuda_include_dir", "crt_include_dir"]

HOW_TO_GET = (
    "pip install 'nvidia-cuda-runtime==13.0.*' (2 MB; the header only is "
    "used, no GPU needed), or set CUDA_HOME to a CUDA toolkit"
)
_WHEEL_DIRS = ("cu13/include", "cuda_runtime/include")


def _candidates() -> list[Path]:
    found = []
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        found.append(Path(home) / "include")
    spec = importlib.util.find_spec("nvidia")  # NVIDIA's wheels' namespace
    roots = (spec.submodule_search_locations or []) if spec else []
    for root in roots:
        found.extend(Path(root) / sub for sub in _WHEEL_DIRS)
    return found


def cuda_include_dir() -> Path | None:
    """The first directory holding cuda.h, or None."""
    for path in _candidates():
        if (path / "cuda.h").is_file():
            return path
    return None


def crt_include_dir() -> Path | None:
    """The first directory holding crt/host_config.h (NVIDIA's
    ``nvidia-cuda-crt`` wheel, or a toolkit), or None: what c10/cuda's
    headers need beside cuda.h, for the landing pool's routing
    (csrc/agent/torch_cuda/); a build without it has no landing pool."""
    for path in _candidates():
        if (path / "crt" / "host_config.h").is_file():
            return path
    return None


if __name__ == "__main__":
    # The folder, or exit status 1 (tools/setup_env.sh asks before building).
    found = cuda_include_dir()
    if found is None:
        raise SystemExit(f"cuda.h not found: {HOW_TO_GET}")
    print(found)
