# SPDX-License-Identifier: BSD-3-Clause
"""The CUDA copy engine's kernels (issue 22), written with numba-cuda and
shipped to C++ as PTX. Nothing here is imported by ``torch_rpc_ext``, and
only kernels.py and the compiling half of ptx.py need numba.

    abi.py      parameters and descriptor layouts, as C++ sees them
    kernels.py  the kernels: one source for the PTX and the simulator
    _memory.py  raw-address loads and stores: intrinsics, or checked ctypes
    ptx.py      PTX per kernel, entry names, on-disk cache, CLI
"""

# What tools/setup_env.sh installs for this package (nvrtc: numba-cuda looks
# it up even to make PTX).
NUMBA_REQUIREMENTS = (
    'numba "numba-cuda==0.30.4" "nvidia-nvvm==13.0.*" "nvidia-cuda-nvrtc==13.0.*"'
)


def missing_numba(what: str) -> ImportError:
    """The error for a missing numba-cuda, saying what to install."""
    return ImportError(f"{what} needs numba-cuda: pip install {NUMBA_REQUIREMENTS}")


def load_kernels() -> None:
    """Compile the copy kernels to PTX (cached on disk, ptx.py) and hand them
    to this process's CUDA channels: done once before a CUDA tensor moves.
    Loads no CUDA library: the driver loads the PTX when an engine is made."""
    from torch_rpc_ext import _C
    from torch_rpc_ext._cuda import ptx

    _C._set_cuda_kernel_images({name: (k.entry, k.ptx) for name, k in ptx.kernel_ptx().items()})
