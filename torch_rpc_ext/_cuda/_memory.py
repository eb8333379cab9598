# SPDX-License-Identifier: BSD-3-Clause
"""Loads and stores at raw device addresses: the only code that differs
between the compiled kernels and the simulated ones.

The kernels (kernels.py) hold every pointer as a uint64 address and touch
memory only through these functions. Compiled (``cuda.compile_ptx``) they are
numba intrinsics that emit one ``inttoptr`` and one aligned global load or
store each (_memory_nvvm.py); under ``NUMBA_ENABLE_CUDASIM=1`` they are Python
functions that check alignment and bounds and then read or write host memory
through ctypes (_memory_sim.py). numba reads the choice when it is imported,
once per process.

    load_u8/16/32/64(addr) -> value      addr aligned to the width
    store_u8/16/32/64(addr, value)       value of exactly that width
    copy16(dst, src)                     16 bytes, both 16-byte aligned

It also hands kernels.py ``numba.cuda`` (``cuda``), so that a missing numba
fails here, with what to install.
"""

from torch_rpc_ext._cuda import missing_numba

try:
    from numba import cuda
    from numba.cuda.core import config as _config
except ImportError as e:
    raise missing_numba("the CUDA copy kernels") from e

if _config.ENABLE_CUDASIM:
    from torch_rpc_ext._cuda._memory_sim import (
        copy16,
        load_u8,
        load_u16,
        load_u32,
        load_u64,
        store_u8,
        store_u16,
        store_u32,
        store_u64,
    )
else:
    from torch_rpc_ext._cuda._memory_nvvm import (
        copy16,
        load_u8,
        load_u16,
        load_u32,
        load_u64,
        store_u8,
        store_u16,
        store_u32,
        store_u64,
    )

SIMULATED = bool(_config.ENABLE_CUDASIM)

__all__ = [
    "SIMULATED",
    "copy16",
    "cuda",
    "load_u8",
    "load_u16",
    "load_u32",
    "load_u64",
    "store_u8",
    "store_u16",
    "store_u32",
    "store_u64",
]
