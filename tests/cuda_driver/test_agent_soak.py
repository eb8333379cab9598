# SPDX-License-Identifier: BSD-3-Clause
"""Both workers calling each other at once, for a while, with random mixes
of CUDA and CPU tensors, some calls nested in others' serves
(soak_worker.py): every byte checked on both sides, on the fake with its
kernels run late (a reader not ordered after a copy sees old bytes) and on
a GPU as they are."""

import os

import pytest

from tests.cuda_driver import soak_worker
from tests.cuda_driver.conftest import REAL_DRIVER, landing_pool_torch, two_devices
from tests.cuda_driver.test_agent_cuda import play_with

pytestmark = pytest.mark.timeout(240)

# Longer, or other seeds, by hand: a soak is worth more the longer it runs.
SECONDS = float(os.environ.get("TORCH_RPC_EXT_TEST_SOAK_SECONDS", "10"))
SEED = int(os.environ.get("TORCH_RPC_EXT_TEST_SOAK_SEED", "1"))
# The workers' watchdog (agent_worker.WATCHDOG_S, 150 s) and gather()'s
# 180 s bound the soak with its start and shutdown.
assert SECONDS <= 100, "TORCH_RPC_EXT_TEST_SOAK_SECONDS: at most 100"


@pytest.mark.parametrize("channels,zero_copy,swap,pool", [
    (("cuda_ipc",), False, False, False),  # landed in torch's memory
    # ... in the landing pool (docs/cuda.md, "The landing pool")
    pytest.param(("cuda_ipc",), False, False, True, marks=landing_pool_torch),
    (("cuda_ipc",), True, False, False),  # views of the sender's blocks, some handed back
    (("cuda_staged",), False, False, False),  # through pinned host memory and the stream
    (("cuda_ring", "cuda_staged"), False, False, False),  # a shared pinned ring, large ones
    # Both map cuda:0 and cuda:1 to the other's cuda:1 and cuda:0: every
    # tensor read peer to peer by the other device (docs/cuda.md, "Peer
    # devices"), views sent as their span arriving on cuda:1.
    pytest.param(("cuda_ipc",), False, True, False, marks=two_devices),
], ids=["landed", "landing_pool", "zero_copy", "staged", "ring", "peer"])
def test_crossing_calls_of_random_cuda_tensors_keep_every_byte(spawn, monkeypatch, channels,
                                                               zero_copy, swap, pool):
    # Late enough that an unordered reader sees old bytes, early enough
    # that the calls are many.
    monkeypatch.setenv("FAKE_CUDA_KERNEL_DELAY_MS", "3")
    if swap:
        monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    # On for zero_copy too: it lands nothing, so nothing comes from a pool.
    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_LANDING_POOL", "1" if pool or zero_copy else "0")
    reports = play_with(spawn, soak_worker.run, SECONDS, SEED, zero_copy, channels, swap)
    print(f"calls: {[r['calls'] for r in reports]}")
    for rank, r in enumerate(reports):
        assert r["failures"] == [], f"worker{rank}: {r['failures']}"
        # Each caller thread of each worker made calls of its own (it goes
        # on past the deadline until it has them: soak_worker.MIN_CALLS).
        assert min(r["calls"]) >= soak_worker.MIN_CALLS, (
            f"worker{rank}'s threads made {r['calls']} calls")
        assert r["receive_failures"] == 0
        # The mode's first channel carried segments of its own (large ones
        # only, for the ring).
        counters = r["counters"][channels[0]]
        assert counters.get("segments", counters.get("segments_sent", 0)) > 0, counters
        if not REAL_DRIVER:
            assert r["poisoned"] == 0
        # The pool holds grants only: landings by copy allocate from
        # torch's default pool, and each grant made is one block of the pool.
        landing = r["landing"]
        if pool:
            assert landing["landing_allocations"] > 0, landing
            assert landing["landing_pool_allocations"] == counters["grants_made"], (
                landing, counters)
            assert landing["landing_pool_segments"] > 0, landing
            # Large tensors went into grants (docs/cuda.md, "Grants"): written
            # by the peer straight into landing memory of ours.
            assert landing["granted_segments"] > 0, landing
            assert counters["grants_used"] > 0 and counters["grants_made"] > 0, counters
            # Sizes vary (3 MiB, 8-9 MiB): grants outgrown are taken back
            # and given back (docs/cuda.md, "Grants", outgrown).
            print(f"worker{rank}: grants made {counters['grants_made']} used "
                  f"{counters['grants_used']} revoked {counters['grants_revoked']} (idle "
                  f"{counters['grants_idle']}) returned {counters['grants_returned']} "
                  f"over the bound {counters['grants_over_limit']}")
            assert counters["grants_capped"] == 0, counters
        else:
            assert landing["landing_pool_allocations"] == 0, landing
            assert landing["landing_pool_segments"] == 0, landing
