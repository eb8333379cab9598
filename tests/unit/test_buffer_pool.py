# SPDX-License-Identifier: BSD-3-Clause
"""Receive-buffer pool: reuse, bounds, and return of idle memory."""

import time

from torch_rpc_ext import _testing

MB = 1 << 20


def test_released_block_is_reused_for_a_similar_size():
    pool = _testing.BufferPool(64 * MB, 60.0)
    addr, cap = pool.acquire(10 * MB)
    assert cap == 10 * MB and addr % (2 * MB) == 0  # huge-page aligned
    pool.release(addr, cap)
    assert pool.cached_bytes == cap and pool.live_blocks == 0
    again, cap2 = pool.acquire(9 * MB)  # fits in the cached block
    assert (again, cap2) == (addr, cap)
    assert pool.cached_bytes == 0 and pool.live_blocks == 1
    pool.release(again, cap2)


def test_blocks_are_page_sized_and_only_large_ones_huge_page_aligned():
    # No rounding up to 2 MiB: a huge page zeroes all of its 2 MiB on first
    # touch, twice a 1 MiB tensor's bytes.
    pool = _testing.BufferPool(64 * MB, 60.0)
    one, one_cap = pool.acquire(MB)
    odd, odd_cap = pool.acquire(3 * MB + 5)
    assert one_cap == MB and odd_cap == 3 * MB + 4096
    assert odd % (2 * MB) == 0
    pool.release(one, one_cap)
    pool.release(odd, odd_cap)


def test_much_larger_block_is_not_handed_out_for_a_small_request():
    pool = _testing.BufferPool(256 * MB, 60.0)
    big, big_cap = pool.acquire(100 * MB)
    pool.release(big, big_cap)
    small, small_cap = pool.acquire(4 * MB)
    assert small != big and small_cap < big_cap
    pool.release(small, small_cap)


def test_cache_is_bounded_and_oversized_blocks_are_not_kept():
    pool = _testing.BufferPool(16 * MB, 60.0)
    blocks = [pool.acquire(6 * MB) for _ in range(4)]
    for b in blocks:
        pool.release(*b)
    assert pool.cached_bytes <= 16 * MB
    huge = pool.acquire(40 * MB)
    pool.release(*huge)
    assert pool.cached_bytes <= 16 * MB


def test_idle_blocks_return_to_the_os_on_trim():
    # 2 s idle: a loaded host holding this thread between the release and
    # the first trim for that long is unlikely (0.2 s was not).
    pool = _testing.BufferPool(64 * MB, 2.0)
    pool.release(*pool.acquire(8 * MB))
    pool.trim()
    assert pool.cached_bytes > 0  # not idle long enough yet
    time.sleep(2.1)
    pool.trim()
    assert pool.cached_bytes == 0
    pool.release(*pool.acquire(8 * MB))
    pool.trim(all=True)
    assert pool.cached_bytes == 0
