# SPDX-License-Identifier: BSD-3-Clause
"""copy_contiguous and copy_segments in numba's simulator, against numpy.

The simulated kernels are the shipped ones (torch_rpc_ext/_cuda/kernels.py);
the simulator's memory checks fail a test on any access outside the bytes a
kernel was given, any misaligned load or store, or any uint64 wrap-around.
Expected bytes are plain numpy slicing in this process.
"""

import numpy as np
import pytest

SIZES = [0, 1, 15, 16, 17, 4095, (1 << 20) + 3]
# (dst offset, src offset) from 256-aligned buffers: agreeing modulo 16, 8, 4,
# 2 or not at all, with and without a head to copy first.
OFFSETS = [(1, 1), (3, 19), (8, 0), (4, 12), (2, 6), (0, 1), (15, 15), (7, 9)]


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def expect_copy(dst: bytes, src: bytes, segments) -> bytes:
    out = np.frombuffer(dst, dtype=np.uint8).copy()
    s = np.frombuffer(src, dtype=np.uint8)
    for dst_off, src_off, n in segments:
        out[dst_off : dst_off + n] = s[src_off : src_off + n]
    return out.tobytes()


def check_copy(sim, nbytes, dst_off, src_off, launch, seed=0):
    src = random_bytes(src_off + nbytes + 32, seed)
    dst = random_bytes(dst_off + nbytes + 32, seed + 1)
    got = sim.run_copy(dst, src, dst_off, src_off, nbytes, launch)
    assert got == expect_copy(dst, src, [(dst_off, src_off, nbytes)])


@pytest.mark.parametrize("nbytes", SIZES)
def test_copy_contiguous_any_size_aligned(sim, nbytes):
    check_copy(sim, nbytes, 0, 0, (4, 32))


@pytest.mark.parametrize("offsets", OFFSETS, ids=str)
@pytest.mark.parametrize("nbytes", [5, 33, 4095])
def test_copy_contiguous_misaligned(sim, offsets, nbytes):
    check_copy(sim, nbytes, *offsets, (2, 32), seed=nbytes)


@pytest.mark.parametrize("launch", [(1, 1), (1, 3), (5, 7), (8, 32)], ids=str)
def test_copy_contiguous_result_does_not_depend_on_launch_shape(sim, launch):
    check_copy(sim, 1000, 5, 21, launch)


def check_segments(sim, sizes, chunk_bytes, launch, *, gather, align=1, seed=0):
    """sizes[i] bytes per tensor; `gather` packs loose tensors (each at a
    random multiple of `align`) into one slab (8-byte aligned rows, as a
    staging slab), else the slab is the source and the tensors the targets."""
    rng = np.random.default_rng(seed)
    loose, slab, segments = 0, 0, []
    for n in sizes:
        loose = -(-(loose + int(rng.integers(0, 48))) // align) * align
        segments.append((slab, loose, n) if gather else (loose, slab, n))
        loose += n
        slab += -(-n // 8) * 8
    dst = random_bytes((slab if gather else loose) + 64, seed + 1)
    src = random_bytes((loose if gather else slab) + 64, seed + 2)
    got = sim.run_segments(dst, src, segments, chunk_bytes, launch)
    assert got == expect_copy(dst, src, segments)


def test_copy_segments_256_tensors_of_16k_gathered(sim):
    check_segments(sim, [16 << 10] * 256, 64 << 10, (4, 32), gather=True, align=256)


def test_copy_segments_1000_tensors_of_1k_scattered(sim):
    check_segments(sim, [1 << 10] * 1000, 4096, (4, 32), gather=False, align=256)


MIXED = [0, 1, 15, 16, 17, 4095, 0, (16 << 10) + 3, 7, 0]


@pytest.mark.parametrize("chunk_bytes", [16, 1000, 4096, 1 << 20])
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "scatter"])
def test_copy_segments_mixed_sizes_any_chunk(sim, chunk_bytes, gather):
    check_segments(sim, MIXED, chunk_bytes, (3, 32), gather=gather, seed=chunk_bytes)


def test_copy_segments_many_chunks_of_one_large_tensor(sim):
    check_segments(sim, [5, 300_001, 9], 8192, (3, 32), gather=True, align=64)


@pytest.mark.parametrize("launch", [(1, 1), (2, 5), (20, 32)], ids=str)
def test_copy_segments_result_does_not_depend_on_launch_shape(sim, launch):
    check_segments(sim, [3, 5000, 0, 77, 4096], 512, launch, gather=True, seed=3)


@pytest.mark.parametrize("sizes", [[], [0], [0, 0, 0]], ids=str)
def test_copy_segments_with_nothing_to_copy_writes_nothing(sim, sizes):
    check_segments(sim, sizes, 4096, (2, 32), gather=True)
