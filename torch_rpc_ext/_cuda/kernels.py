# SPDX-License-Identifier: BSD-3-Clause
"""The copy engine's kernels, for numba-cuda: one source, two uses.

ptx.py compiles these functions with ``cuda.compile_ptx`` into the PTX that
C++ loads with ``cuModuleLoadData`` and launches with ``cuLaunchKernel``; the
tests run the very same functions in numba's simulator. What keeps the tested
logic the shipped logic:

- Every parameter is a uint64 (an address or a count), so the simulator gets
  the same integers the GPU does, never NumPy arrays (whose kernel ABI is
  numba's own and differs from the simulator's).
- Memory is touched only through _memory.py (load_u8 ... copy16). That module
  is the one place where the two uses differ: numba intrinsics when compiled,
  checked ctypes accesses in the simulator. All index math, tails, alignment
  choices, chunking and descriptor walking are below, shared.
- Index math is uint64 throughout, with uint64 constants: numba would turn
  ``uint64 + 1`` into float64 (the PTX tests reject any float instruction),
  and in the simulator any unsigned wrap-around is raised as an error.

Launch shapes are free: every kernel loops (grid-stride or block-stride), so
any grid and block size gives the same result; C++ picks them for speed.
"""

import numpy as np

from torch_rpc_ext._cuda import abi
from torch_rpc_ext._cuda._memory import (
    copy16,
    cuda,
    load_u8,
    load_u16,
    load_u32,
    load_u64,
    store_u8,
    store_u16,
    store_u32,
    store_u64,
)

__all__ = ["copy_contiguous", "copy_segments", "pack_strided", "unpack_strided"]

_0, _1, _2, _4, _8, _16 = (np.uint64(v) for v in (0, 1, 2, 4, 8, 16))
_ROW_BYTES = np.uint64(abi.SEGMENT_ROW_WORDS * 8)
_DST, _SRC, _NBYTES, _BEGIN = (
    np.uint64(w * 8)
    for w in (
        abi.SEGMENT_DST,
        abi.SEGMENT_SRC,
        abi.SEGMENT_NBYTES,
        abi.SEGMENT_CHUNK_BEGIN,
    )
)
_NDIM, _ELEM_SIZE, _NUMEL, _SIZES = (
    np.uint64(w * 8)
    for w in (
        abi.STRIDED_NDIM,
        abi.STRIDED_ELEM_SIZE,
        abi.STRIDED_NUMEL,
        abi.STRIDED_SIZES,
    )
)


@cuda.jit(device=True)
def _copy_unit(dst, src, unit):
    """Copy one naturally aligned unit of 16, 8, 4, 2 or 1 bytes."""
    if unit == _16:
        copy16(dst, src)
    elif unit == _8:
        store_u64(dst, load_u64(src))
    elif unit == _4:
        store_u32(dst, load_u32(src))
    elif unit == _2:
        store_u16(dst, load_u16(src))
    else:
        store_u8(dst, load_u8(src))


@cuda.jit(device=True)
def _copy_span(dst, src, nbytes, rank, nranks):
    """Worker ``rank`` of ``nranks`` copies its share of nbytes from src to dst.

    The unit is the widest of 16/8/4/2/1 to which dst and src can both be
    aligned (they agree modulo it). The head (up to dst's next unit boundary)
    and the tail (after the last whole unit) are copied byte by byte.
    """
    unit = _1
    shift = _0
    mismatch = dst ^ src
    for _ in range(4):
        if mismatch & (unit + unit - _1) == _0:
            unit = unit + unit
            shift = shift + _1
    head = (unit - (dst & (unit - _1))) & (unit - _1)
    if head > nbytes:
        head = nbytes
    units = (nbytes - head) >> shift
    tail_begin = head + (units << shift)
    edges = head + (nbytes - tail_begin)
    i = rank
    while i < units:
        offset = head + (i << shift)
        _copy_unit(dst + offset, src + offset, unit)
        i += nranks
    j = rank
    while j < edges:
        offset = j
        if j >= head:
            offset = tail_begin + (j - head)
        store_u8(dst + offset, load_u8(src + offset))
        j += nranks


def copy_contiguous(dst, src, nbytes):
    """nbytes from src to dst, the whole grid striding over the units."""
    rank = np.uint64(cuda.grid(1))
    nranks = np.uint64(cuda.gridsize(1))
    _copy_span(dst, src, nbytes, rank, nranks)


@cuda.jit(device=True)
def _find_row(table, count, chunk):
    """The last row whose chunk_begin <= chunk (row 0 begins at 0)."""
    lo = _0
    hi = count
    while hi - lo > _1:
        mid = lo + ((hi - lo) >> _1)
        if load_u64(table + mid * _ROW_BYTES + _BEGIN) <= chunk:
            lo = mid
        else:
            hi = mid
    return lo


def copy_segments(table, count, chunk_bytes):
    """Every row of a segment table; each block copies whole chunks."""
    if count == _0 or chunk_bytes == _0:
        return
    last = table + (count - _1) * _ROW_BYTES
    last_bytes = load_u64(last + _NBYTES)
    total = load_u64(last + _BEGIN) + (last_bytes + chunk_bytes - _1) // chunk_bytes
    rank = np.uint64(cuda.threadIdx.x)
    nranks = np.uint64(cuda.blockDim.x)
    chunk = np.uint64(cuda.blockIdx.x)
    while chunk < total:
        row = table + _find_row(table, count, chunk) * _ROW_BYTES
        nbytes = load_u64(row + _NBYTES)
        offset = (chunk - load_u64(row + _BEGIN)) * chunk_bytes
        if offset < nbytes:
            n = nbytes - offset
            if n > chunk_bytes:
                n = chunk_bytes
            dst = load_u64(row + _DST) + offset
            src = load_u64(row + _SRC) + offset
            _copy_span(dst, src, n, rank, nranks)
        chunk += np.uint64(cuda.gridDim.x)


@cuda.jit(device=True)
def _copy_element(dst, src, elem_size):
    """One element of 1, 2, 4, 8 or 16 bytes (16 as two 8-byte words)."""
    if elem_size == _16:
        store_u64(dst, load_u64(src))
        store_u64(dst + _8, load_u64(src + _8))
    else:
        _copy_unit(dst, src, elem_size)


@cuda.jit(device=True)
def _strided_copy(contiguous, strided, desc, pack):
    """Element i of the view <-> element i of the row-major buffer."""
    ndim = load_u64(desc + _NDIM)
    elem_size = load_u64(desc + _ELEM_SIZE)
    numel = load_u64(desc + _NUMEL)
    sizes = desc + _SIZES
    strides = sizes + ndim * _8
    i = np.uint64(cuda.grid(1))
    while i < numel:
        rest = i
        offset = _0
        d = ndim
        while d > _0:
            d -= _1
            size = load_u64(sizes + d * _8)
            offset += (rest % size) * load_u64(strides + d * _8)
            rest = rest // size
        a = contiguous + i * elem_size
        b = strided + offset * elem_size
        if pack:
            _copy_element(a, b, elem_size)
        else:
            _copy_element(b, a, elem_size)
        i += np.uint64(cuda.gridsize(1))


def pack_strided(dst, src, desc):
    """The view at src (descriptor at desc) into the contiguous dst."""
    _strided_copy(dst, src, desc, True)


def unpack_strided(dst, src, desc):
    """The contiguous src into the view at dst (descriptor at desc)."""
    _strided_copy(src, dst, desc, False)
