# SPDX-License-Identifier: BSD-3-Clause
"""The landing pool (docs/cuda.md, "The landing pool"): the landing memory
a receiver grants its peers comes from a pool of torch's caching allocator
whose segments our library makes and releases. Through the agent:
test_agent_soak.py (`landing_pool`) and test_agent_cuda.py (a granted
tensor on a busy side stream, and the grants' tests). Here, on the
fake's caching allocator, which models torch's pools: the segments' life,
the routing windows, and the error where nothing can route."""

import json

import pytest

from tests.cuda_driver.conftest import fake_only
from tests.cuda_driver.test_driver_layer import run_python

pytestmark = [pytest.mark.unit, fake_only]

SETUP = """
    import json
    import torch
    from tests.cuda_driver import agent_worker as aw
    from torch_rpc_ext import _C
    from torch_rpc_ext._cuda import landing_pool
    cu = aw.cu()
"""

LIFE = SETUP + """
    aw.setup_torch()
    torch.cuda.init()
    out = {"routing": _C._pool_routing()}
    pools = landing_pool.landing_pools([torch.device("cuda:0")])
    pool = pools[0]
    out["same_pool_again"] = landing_pool.landing_pools([torch.device("cuda:0")]) == pools
    seen = lambda: _C._landing_pool_segments()
    a = cu.pool_allocate(0, pool, 3 << 20)
    b = cu.pool_allocate(0, pool, 3 << 20)
    outside = cu.allocate(0, 3 << 20)  # no window open: torch's default pool
    out["two_live"] = seen()
    where = a.address
    a.free()
    c = cu.pool_allocate(0, pool, 3 << 20)  # a's block again, on its stream
    out["reused"] = (c.address == where, seen()["made"])
    c.free(); b.free(); outside.free()
    cu.empty_cache()  # leaves a live pool's segments
    out["after_empty_cache"] = seen()
    cu.begin_allocate_to_pool(0, pool)
    try:
        cu.begin_allocate_to_pool(0, pool)
    except RuntimeError as e:
        out["second_window"] = str(e)
    cu.end_allocate_to_pool(0, pool)
    cu.destroy_pool(pool)  # the MemPool's end: its segments given back to us
    out["after_destroy"] = seen()
    out["allocator"] = cu.allocator_stats()
    print(json.dumps(out))
"""


def test_segments_live_with_the_pool_and_are_freed_through_us(driver_env):
    done = run_python(LIFE, driver_env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["routing"] == "test"
    assert out["same_pool_again"]  # one pool per device for the process
    assert out["two_live"] == {"live": 2, "live_bytes": 2 * (3 << 20), "made": 2, "freed": 0,
                               "failed": 0}
    assert out["reused"] == [True, 2]
    # torch's empty_cache() frees no segment of a live pool...
    assert out["after_empty_cache"]["live"] == 2
    assert "already recording" in out["second_window"]
    # ... its end gives them back, through torch_rpc_ext_landing_free.
    assert out["after_destroy"] == {"live": 0, "live_bytes": 0, "made": 2, "freed": 2,
                                    "failed": 0}
    stats = out["allocator"]
    assert (stats["pool_allocated"], stats["pool_reused"], stats["pool_released"]) == (2, 1, 2)


OUT_OF_MEMORY = SETUP + """
    aw.setup_torch()
    torch.cuda.init()
    (pool,) = landing_pool.landing_pools([torch.device("cuda:0")]).values()
    cu.cache_bytes(0, 6 << 20)  # torch's default pool caches 6 of the fake's 8 MiB
    out = {}
    try:
        cu.pool_allocate(0, pool, 4 << 20)
    except Exception as e:
        out["error"] = type(e).__name__ + ": " + str(e)
    out["segments"] = _C._landing_pool_segments()
    out["allocator"] = cu.allocator_stats()
    print(json.dumps(out))
"""


def test_out_of_memory_in_the_pool_leaves_torchs_cache_alone(driver_env):
    """Only grants allocate from the pool, and a grant is not worth the
    user's cache: out of memory, the pool's allocation fails as torch's
    does (the grant is then not made, and the segment lands by copy, in
    torch's default pool, where torch frees its cache and retries)."""
    done = run_python(OUT_OF_MEMORY, {**driver_env, "FAKE_CUDA_MEM_LIMIT": str(8 << 20)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert "out of memory" in out["error"].lower(), out
    assert out["segments"]["failed"] == 1 and out["segments"]["live"] == 0
    assert out["allocator"]["emptied"] == 0


SHARED = SETUP + """
    aw.setup_torch()
    torch.cuda.init()
    (pool,) = landing_pool.landing_pools([torch.device("cuda:0")]).values()
    grants = cu.pool_grants(0, pool)
    address, key, base, size = grants.allocate(0, 3 << 20)
    out = {}
    grants.shared(key)  # a peer was sent a grant in it
    grants.free(address)
    cu.destroy_pool(pool)  # torch gives the segment back to us...
    out["while_shared"] = _C._landing_pool_segments()
    grants.unshared(key)  # ... and the peer's mapping is gone
    out["after"] = _C._landing_pool_segments()
    print(json.dumps(out))
"""


def test_a_segment_a_peer_may_have_open_is_freed_only_once_it_may_not(driver_env):
    """cuda.h: cuMemFree of exported memory before the importer's
    cuIpcCloseMemHandle is undefined. torch frees a pool's segments when it
    decides to; a segment a grant named to a peer is freed by us only once
    that peer's connection let it go (docs/cuda.md, "Grants")."""
    done = run_python(SHARED, driver_env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["while_shared"]["live"] == 1 and out["while_shared"]["freed"] == 0
    assert out["after"]["live"] == 0 and out["after"]["freed"] == 1


NO_ROUTING = SETUP + """
    try:
        landing_pool.landing_pools([torch.device("cuda:0")])
    except RuntimeError as e:
        print(json.dumps({"routing": _C._pool_routing(), "error": str(e)}))
"""


def test_without_a_way_to_route_the_pool_is_refused_naming_why(driver_env):
    """A CPU torch with no fake guard: no CUDA caching allocator to route."""
    done = run_python(NO_ROUTING, driver_env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["routing"] == ""
    assert "TORCH_RPC_EXT_CUDA_LANDING_POOL=1" in out["error"]
    assert "nvidia-cuda-crt" in out["error"]


@pytest.mark.parametrize("version,backend,refused", [
    ("2.11.0+cu130", "native", "pytorch#175015"),
    ("2.12.1", "native", "pytorch#175015"),
    ("2.13.0+cu130", "native", None),
    ("2.15.0", "cudaMallocAsync", "'cudaMallocAsync'"),
])
def test_torch_before_2_13_and_other_allocators_are_refused(version, backend, refused):
    from torch_rpc_ext._cuda import landing_pool

    if refused is None:
        landing_pool.check_torch(version, backend)
        return
    with pytest.raises(RuntimeError, match=refused):
        landing_pool.check_torch(version, backend)


def test_a_bad_setting_is_named(monkeypatch):
    from torch_rpc_ext._cuda import landing_pool

    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_LANDING_POOL", "yes")
    with pytest.raises(ValueError, match="TORCH_RPC_EXT_CUDA_LANDING_POOL must be 0 or 1"):
        landing_pool.enabled()
