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
    return ImportError(
        f"{what} needs numba-cuda: pip install 'torch_rpc_ext[cuda]' "
        f"(or pip install {NUMBA_REQUIREMENTS})"
    )


def load_kernels() -> None:
    """Hand the copy kernels' PTX to this process's CUDA channels: done once
    before a CUDA tensor moves. The PTX the package ships (ptx.py: ISA 6.0,
    sm_70, any driver from CUDA 9.0 on; no numba needed), unless
    TORCH_RPC_EXT_PTX=compile asks for it to be compiled here with numba-cuda
    (cached on disk; NVVM 13 writes ISA 9.0, for R580 drivers only). Loads no
    CUDA library: the driver loads the PTX when an engine is made, after the
    engine checked its ISA against the driver's version."""
    import os

    from torch_rpc_ext import _C
    from torch_rpc_ext._cuda import ptx

    mode = os.environ.get("TORCH_RPC_EXT_PTX", "shipped")
    if mode not in ("shipped", "compile"):
        raise ValueError(f"TORCH_RPC_EXT_PTX must be 'shipped' or 'compile', got {mode!r}")
    kernels = ptx.shipped_ptx() if mode == "shipped" else None
    if kernels is None:
        kernels = ptx.kernel_ptx()
    _C._set_cuda_kernel_images({name: (k.entry, k.ptx) for name, k in kernels.items()})
