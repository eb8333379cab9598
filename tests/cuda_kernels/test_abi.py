# SPDX-License-Identifier: BSD-3-Clause
"""The descriptor builders (the reference for C++'s): layouts and validation."""

import math

import numpy as np
import pytest

from torch_rpc_ext._cuda import abi


def test_segment_table_rows_and_chunk_prefix():
    sizes = [0, 1, 4096, 4097, 0, 100_000]
    rows = [(1000 + i, 2000 + i, n) for i, n in enumerate(sizes)]
    table = abi.segment_table(rows, 4096)
    assert table.dtype == np.uint64 and table.flags.c_contiguous
    assert table.shape == (len(rows), abi.SEGMENT_ROW_WORDS)
    begins = np.cumsum([0] + [math.ceil(n / 4096) for n in sizes])[:-1]
    assert table[:, abi.SEGMENT_CHUNK_BEGIN].tolist() == begins.tolist()
    assert table[:, abi.SEGMENT_NBYTES].tolist() == sizes
    assert table[:, abi.SEGMENT_DST].tolist() == [r[0] for r in rows]
    assert table[:, abi.SEGMENT_SRC].tolist() == [r[1] for r in rows]


@pytest.mark.parametrize("chunk_bytes", [0, -16])
def test_segment_table_rejects_a_chunk_size_below_one(chunk_bytes):
    with pytest.raises(ValueError, match="chunk_bytes"):
        abi.segment_table([(0, 0, 1)], chunk_bytes)


def test_strided_descriptor_layout():
    desc = abi.strided_descriptor([3, 4, 5], [40, 1, 8], 2)
    assert desc.dtype == np.uint64
    assert desc.tolist() == [3, 2, 60, 3, 4, 5, 40, 1, 8]
    assert abi.strided_descriptor([], [], 8).tolist() == [0, 8, 1]


@pytest.mark.parametrize(
    "sizes, strides, elem_size",
    [([2], [1, 1], 4), ([2], [1], 3), ([2], [-1], 4), ([-2], [1], 4)],
)
def test_strided_descriptor_rejects_what_kernels_cannot_walk(sizes, strides, elem_size):
    with pytest.raises(ValueError):
        abi.strided_descriptor(sizes, strides, elem_size)


def test_every_kernel_takes_three_u64_parameters():
    assert [(k.name, len(k.params)) for k in abi.KERNELS] == [
        ("copy_contiguous", 3),
        ("copy_segments", 3),
        ("pack_strided", 3),
        ("unpack_strided", 3),
    ]
