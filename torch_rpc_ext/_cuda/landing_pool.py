# SPDX-License-Identifier: BSD-3-Clause
"""The landing pool (docs/cuda.md, "The landing pool"): per CUDA device of
an agent, a pool of torch's caching allocator whose segments our library
makes (``torch_rpc_ext_landing_alloc`` and ``_free`` in ``_C``), which the
landing memory the agent grants its peers is allocated from (landings by
copy use torch's default pool). Its blocks are torch's memory, as a landing
in the default pool is (``record_stream`` works on them); its segments
stay ours, which is what lets a peer write into a block it was granted
without cuda.h's undefined order: a segment is released only when we say.

Off unless ``TORCH_RPC_EXT_CUDA_LANDING_POOL=1`` while the layers above it
are built (issue 46). One pool per device for the process's life, shared
by the agents it runs one after another (torch frees none of a live
pool's segments: a pool per agent would keep each one's).
"""

import os

import torch

__all__ = ["ENV", "enabled", "landing_pools"]

ENV = "TORCH_RPC_EXT_CUDA_LANDING_POOL"

# device index -> the MemPool (a CUDA torch) or the fake's pool id (tests).
_POOLS: dict = {}


def enabled() -> bool:
    """Whether grants and their landing pool are on
    ($TORCH_RPC_EXT_CUDA_LANDING_POOL: "1" on, "0" or unset off; anything
    else is an error naming it)."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _make(index: int, routing: str):
    from torch_rpc_ext import _C

    if routing == "test":
        from torch_rpc_ext import _testing

        return _testing.cuda.make_landing_pool(index)
    from torch.cuda.memory import CUDAPluggableAllocator

    allocator = CUDAPluggableAllocator(
        _C.__file__, "torch_rpc_ext_landing_alloc", "torch_rpc_ext_landing_free"
    )
    with torch.cuda.device(index):
        return torch.cuda.MemPool(allocator=allocator.allocator())


# torch before 2.13 treats any routing to a pool as a CUDA graph capture
# across the device (pytorch#175015): a stream recorded on a block freed
# while a window is open is dropped, so its memory could be reused under a
# kernel still reading it.
FIRST_TORCH = (2, 13)


def check_torch(version: str, backend: str) -> None:
    """Raises, naming why, where torch ``version`` with allocator ``backend``
    cannot hold the landing pool."""
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if release < FIRST_TORCH:
        raise RuntimeError(
            f"{ENV}=1 needs torch 2.13 or newer, and this is {version}: before 2.13, "
            "routing allocations to a pool makes torch's caching allocator act as in a "
            "CUDA graph capture across the device (pytorch#175015), which drops the "
            "streams a freed tensor was recorded on"
        )
    if backend != "native":
        raise RuntimeError(
            f"{ENV}=1 needs torch's native CUDA caching allocator, and this process "
            f"uses {backend!r} (PYTORCH_CUDA_ALLOC_CONF backend): it has no pools"
        )


def landing_pools(devices) -> dict:
    """{device index: pool id} for ``devices`` (torch.device), made on first
    use. Raises, naming why, where this torch or build has no way to route
    allocations to a pool."""
    from torch_rpc_ext import _C

    routing = _C._pool_routing()
    if not routing:
        raise RuntimeError(
            f"{ENV}=1, but this build of torch_rpc_ext cannot route allocations to a "
            "pool of torch's CUDA caching allocator (a CPU torch, or built without "
            "crt/host_config.h: pip install 'nvidia-cuda-crt==13.0.*' and rebuild)"
        )
    if routing == "torch":
        check_torch(torch.__version__, torch.cuda.get_allocator_backend())
    ids = {}
    for device in devices:
        index = device.index
        if index not in _POOLS:
            _POOLS[index] = _make(index, routing)
        pool = _POOLS[index]
        ids[index] = tuple(pool.id) if hasattr(pool, "id") else tuple(pool)
    return ids
