# SPDX-License-Identifier: BSD-3-Clause
"""Runs the copy kernels in numba's simulator, in a process of its own.

numba chooses the simulator once, when it is imported, from
NUMBA_ENABLE_CUDASIM; the pytest process compiles real PTX, so the simulated
kernels live in a spawned worker (conftest.py) whose initializer, start(),
sets the variable first. The worker only runs kernels: it copies the inputs
into 256-byte aligned buffers (as cudaMalloc's), maps exactly the bytes each
kernel may touch (_memory_sim.map_region) and returns the buffers afterwards.
The expected results are computed by the tests, in the pytest process, with
numpy alone.
"""

import os
import warnings
from contextlib import contextmanager

import numpy as np

ALIGN = 256


def start() -> None:
    """Process initializer: the simulator on, before anything imports numba."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # numpy warns where uint64 arithmetic wraps: the kernels never mean to.
    warnings.simplefilter("error", RuntimeWarning)
    from torch_rpc_ext._cuda import _memory

    assert _memory.SIMULATED


def _aligned(data: bytes) -> np.ndarray:
    raw = np.zeros(len(data) + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    buf = raw[start : start + len(data)]
    buf[:] = np.frombuffer(data, dtype=np.uint8)
    return buf


@contextmanager
def _mapped(*regions: tuple[int, int, bool]):
    """Map the regions for one kernel run; afterwards require that it stored
    every byte of every writable region exactly once."""
    from torch_rpc_ext._cuda import _memory_sim

    for addr, nbytes, writable in regions:
        _memory_sim.map_region(addr, nbytes, writable=writable)
    try:
        yield
        for start, counts in _memory_sim.store_counts():
            if (bad := np.flatnonzero(counts != 1)).size:
                raise AssertionError(
                    f"{bad.size} bytes from {start:#x} + {bad[0]} were stored "
                    f"{counts[bad[0]]} times, not once"
                )
    finally:
        _memory_sim.unmap_all()


def _launch(name: str, launch: tuple[int, int], *args: int) -> None:
    from numba import cuda

    from torch_rpc_ext._cuda import kernels

    grid, block = launch
    cuda.jit(getattr(kernels, name))[grid, block](*(np.uint64(a) for a in args))


def run_copy(dst, src, dst_off, src_off, nbytes, launch) -> bytes:
    """copy_contiguous of nbytes at src+src_off to dst+dst_off; dst after."""
    d, s = _aligned(dst), _aligned(src)
    dst_addr, src_addr = d.ctypes.data + dst_off, s.ctypes.data + src_off
    with _mapped((dst_addr, nbytes, True), (src_addr, nbytes, False)):
        _launch("copy_contiguous", launch, dst_addr, src_addr, nbytes)
    return d.tobytes()


def run_segments(dst, src, segments, chunk_bytes, launch) -> bytes:
    """copy_segments over (dst_off, src_off, nbytes) rows; dst after."""
    from torch_rpc_ext._cuda import abi

    d, s = _aligned(dst), _aligned(src)
    rows = [(d.ctypes.data + a, s.ctypes.data + b, n) for a, b, n in segments]
    table = _aligned(abi.segment_table(rows, chunk_bytes).tobytes())
    regions = [(table.ctypes.data, table.nbytes, False)]
    for dst_addr, src_addr, n in rows:
        regions += [(dst_addr, n, True), (src_addr, n, False)]
    with _mapped(*regions):
        _launch("copy_segments", launch, table.ctypes.data, len(rows), chunk_bytes)
    return d.tobytes()


def run_strided(pack, strided, contiguous, offset, sizes, strides, elem_size, launch):
    """pack_strided or unpack_strided of the view (offset, sizes, strides in
    elements) of the buffer `strided`; both buffers after."""
    from torch_rpc_ext._cuda import abi

    st, co = _aligned(strided), _aligned(contiguous)
    desc = _aligned(abi.strided_descriptor(sizes, strides, elem_size).tobytes())
    view_addr = st.ctypes.data + offset * elem_size
    # Exactly the view's elements, found by numpy's own striding.
    index = np.arange(st.nbytes // elem_size, dtype=np.int64)
    elements = np.lib.stride_tricks.as_strided(
        index[offset:], sizes, [s * 8 for s in strides]
    )
    regions = [
        (desc.ctypes.data, desc.nbytes, False),
        (co.ctypes.data, co.nbytes, pack),
    ]
    for e in np.unique(elements):
        regions.append((st.ctypes.data + int(e) * elem_size, elem_size, not pack))
    with _mapped(*regions):
        if pack:
            _launch("pack_strided", launch, co.ctypes.data, view_addr, desc.ctypes.data)
        else:
            _launch(
                "unpack_strided", launch, view_addr, co.ctypes.data, desc.ctypes.data
            )
    return st.tobytes(), co.tobytes()
