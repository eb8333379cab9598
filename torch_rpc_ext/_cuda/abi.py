# SPDX-License-Identifier: BSD-3-Clause
"""The copy kernels as the C++ side sees them: entry parameters and the layouts
of the descriptor tables they read from device memory.

Every parameter of every kernel is one ``.u64``: a device address or a count.
C++ passes ``void* args[] = {&a, &b, &c}`` (each a ``uint64_t``) to
``cuLaunchKernel``. Tables are arrays of little-endian ``uint64_t`` words in
device memory, 8-byte aligned. The builders below are the reference for the
C++ code that fills them; they need numpy, never numba.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "KERNELS",
    "KernelSpec",
    "SEGMENT_ROW_WORDS",
    "segment_table",
    "strided_descriptor",
]


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its Python name and its parameters, in launch order."""

    name: str
    params: tuple[str, ...]


KERNELS = (
    # Copies nbytes from src to dst (any alignment; 16-byte vectors where the
    # two addresses agree modulo 16). Grid-stride: any grid covers any size.
    KernelSpec("copy_contiguous", ("dst", "src", "nbytes")),
    # Copies every row of a segment table (segment_table) in one launch: a
    # block per chunk of chunk_bytes, grid-stride over all chunks.
    KernelSpec("copy_segments", ("table", "count", "chunk_bytes")),
    # Packs the strided view at src (strided_descriptor at desc) into the
    # contiguous buffer at dst, in row-major order.
    KernelSpec("pack_strided", ("dst", "src", "desc")),
    # The inverse: the contiguous buffer at src into the strided view at dst.
    KernelSpec("unpack_strided", ("dst", "src", "desc")),
)

# A segment table row: (dst, src, nbytes, chunk_begin). chunk_begin is the
# number of chunks of all rows before it, so row 0 has 0 and the table is
# sorted by it; a kernel block finds its row by binary search.
SEGMENT_ROW_WORDS = 4
SEGMENT_DST, SEGMENT_SRC, SEGMENT_NBYTES, SEGMENT_CHUNK_BEGIN = range(4)

# A strided descriptor: (ndim, elem_size, numel, sizes[ndim], strides[ndim]),
# strides in elements (torch's convention), outermost dimension first.
STRIDED_NDIM, STRIDED_ELEM_SIZE, STRIDED_NUMEL, STRIDED_SIZES = range(4)
ELEM_SIZES = (1, 2, 4, 8, 16)


def segment_table(
    segments: Sequence[tuple[int, int, int]], chunk_bytes: int
) -> np.ndarray:
    """The table ``copy_segments`` reads, one row per (dst, src, nbytes).

    Gather (many tensors into one staging slab) and scatter (out of it) are
    the same table with the slab on the dst or on the src side.

    Args:
        segments: (dst address, src address, byte count) per tensor; counts of
            0 are allowed and copy nothing.
        chunk_bytes: The most bytes one block copies of one row; a multiple of
            16 keeps every chunk on the 16-byte vector path.

    Returns:
        A (len(segments), SEGMENT_ROW_WORDS) uint64 array, C-contiguous.

    Raises:
        ValueError: chunk_bytes is not positive, or a value does not fit u64.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive: {chunk_bytes}")
    table = np.zeros((len(segments), SEGMENT_ROW_WORDS), dtype=np.uint64)
    begin = 0
    for row, (dst, src, nbytes) in enumerate(segments):
        if min(dst, src, nbytes) < 0:
            raise ValueError(f"segment {row} has a negative value")
        table[row] = (dst, src, nbytes, begin)
        begin += -(-nbytes // chunk_bytes)
    return table


def strided_descriptor(
    sizes: Sequence[int], strides: Sequence[int], elem_size: int
) -> np.ndarray:
    """The descriptor ``pack_strided``/``unpack_strided`` read for one view.

    Args:
        sizes: The view's sizes, outermost first (torch's ``size()``).
        strides: Its strides in elements (torch's ``stride()``); none
            negative. Unpacking into a view with overlapping elements (a zero
            stride) has no defined result, as in torch.
        elem_size: Bytes per element, one of ELEM_SIZES. Both addresses must be
            aligned to min(elem_size, 8), which torch's allocations are.

    Returns:
        A uint64 array of 3 + 2 * ndim words.

    Raises:
        ValueError: The lengths differ, a value is negative, or elem_size is
            not supported.
    """
    if len(sizes) != len(strides):
        raise ValueError(f"{len(sizes)} sizes but {len(strides)} strides")
    if elem_size not in ELEM_SIZES:
        raise ValueError(f"elem_size must be one of {ELEM_SIZES}: {elem_size}")
    if min([*sizes, *strides], default=0) < 0:
        raise ValueError(f"negative size or stride: {sizes}, {strides}")
    words = [len(sizes), elem_size, math.prod(sizes), *sizes, *strides]
    return np.array(words, dtype=np.uint64)
