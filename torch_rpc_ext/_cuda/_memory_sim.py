# SPDX-License-Identifier: BSD-3-Clause
"""The simulated side of _memory.py: host memory through ctypes, checked.

Under the numba simulator "device memory" is host memory, so an address is a
real host address (``ndarray.ctypes.data``) and a load reads it. Each access
first checks what the compiled intrinsic takes for granted or fails to type:
the address is a uint64 and aligned to the width, a stored value has exactly
that width, and every byte lies in a region mapped with map_region (writable
for stores). A violation raises SimulatedFault, so a kernel that strays one
byte outside its tensors, or loses alignment on the vector path, fails its
test instead of corrupting memory. Stores are counted per byte of each
writable region (store_counts), so a test can also require that every byte
was written exactly once: none skipped, none copied twice.
"""

import bisect
import ctypes
import threading

import numpy as np

__all__ = [
    "SimulatedFault",
    "copy16",
    "load_u8",
    "load_u16",
    "load_u32",
    "load_u64",
    "map_region",
    "store_counts",
    "store_u8",
    "store_u16",
    "store_u32",
    "store_u64",
    "unmap_all",
]


class SimulatedFault(RuntimeError):
    """A simulated kernel touched memory it may not, or misaligned."""


_lock = threading.Lock()
_starts: list[int] = []  # sorted; _regions[i] = (start, end, store counts)
_regions: list[tuple[int, int, np.ndarray | None]] = []  # None: read-only


def map_region(addr: int, nbytes: int, *, writable: bool) -> None:
    """Let simulated kernels read (and, if writable, write) [addr, addr+nbytes)."""
    if nbytes <= 0:
        return
    with _lock:
        i = bisect.bisect_right(_starts, addr)
        _starts.insert(i, addr)
        counts = np.zeros(nbytes, dtype=np.int64) if writable else None
        _regions.insert(i, (addr, addr + nbytes, counts))


def store_counts() -> list[tuple[int, np.ndarray]]:
    """(start, stores per byte) of every writable region, by address."""
    with _lock:
        return [(start, c.copy()) for start, _, c in _regions if c is not None]


def unmap_all() -> None:
    """Forget every mapped region."""
    with _lock:
        _starts.clear()
        _regions.clear()


def _check(addr, size: int, write: bool) -> int:
    if type(addr) is not np.uint64:
        raise SimulatedFault(f"address {addr!r} is not a uint64")
    a = int(addr)
    if a % size:
        raise SimulatedFault(f"{size}-byte access at {a:#x} is misaligned")
    i = bisect.bisect_right(_starts, a) - 1
    # Regions may overlap (a view of a mapped buffer): any that holds it does.
    while i >= 0:
        start, end, counts = _regions[i]
        if a + size <= end and not write:
            return a
        if a + size <= end and counts is not None:
            counts[a - start : a - start + size] += 1
            return a
        i -= 1
    kind = "store" if write else "load"
    raise SimulatedFault(f"{kind} of {size} bytes at {a:#x} is outside mapped memory")


def _make(bits: int):
    value_type = getattr(np, f"uint{bits}")
    c_type = getattr(ctypes, f"c_uint{bits}")
    size = bits // 8

    def load(addr):
        return value_type(c_type.from_address(_check(addr, size, False)).value)

    def store(addr, value):
        if type(value) is not value_type:
            raise SimulatedFault(f"store_u{bits} of {value!r}")
        c_type.from_address(_check(addr, size, True)).value = int(value)

    load.__name__, store.__name__ = f"load_u{bits}", f"store_u{bits}"
    return load, store


load_u8, store_u8 = _make(8)
load_u16, store_u16 = _make(16)
load_u32, store_u32 = _make(32)
load_u64, store_u64 = _make(64)


def copy16(dst, src):
    """Copy 16 bytes; both addresses 16-byte aligned."""
    ctypes.memmove(_check(dst, 16, True), _check(src, 16, False), 16)
