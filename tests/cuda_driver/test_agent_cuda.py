# SPDX-License-Identifier: BSD-3-Clause
"""CUDA tensors through the agent: device maps, cuda_ipc, arrival streams
and futures with devices, two workers in spawned processes on the driver
under test (the fake, with a fake CUDA device guard for the CPU torch, in
CI; the GPU and torch's own on a GPU machine: agent_worker.py)."""

import time

import pytest

from tests.cuda_driver import agent_worker
from tests.cuda_driver.conftest import (
    REAL_DRIVER,
    fake_only,
    landing_pool_torch,
    two_devices,
)
from tests.rpc.world import free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("slow_kernels")]


def play(spawn, channels=("cuda_ipc",), target=0, transports=None):
    """Runs both workers; returns what each reported."""
    return play_with(spawn, agent_worker.run, channels, target, transports)


def play_with(spawn, worker, *args):
    """Runs `worker(rank, port, pipe, *args)` in two processes; returns what
    each reported."""
    port = free_port()
    pipes = [spawn.Pipe() for _ in range(2)]
    procs = [
        spawn.Process(target=worker, args=(rank, port, pipes[rank][1], *args))
        for rank in range(2)
    ]
    return gather(procs, pipes)


def gather(procs, pipes, limit: float = 180):
    """Starts the workers; returns what each reported down its pipe, once
    all have exited with 0, or fails naming those that did not report (a
    hung worker prints its stacks to stderr first: agent_worker's
    watchdog)."""
    for p in procs:
        p.start()
    try:
        out = [None] * len(procs)
        deadline = time.monotonic() + limit
        # Until all report, or one dies (then its peers would wait for it).
        while None in out and time.monotonic() < deadline:
            for r, (ours, _) in enumerate(pipes):
                if out[r] is None and ours.poll(0.2):
                    out[r] = ours.recv()
            if any(p.exitcode not in (None, 0) for p in procs):
                break
        for p in procs:
            p.join(max(5.0, min(60.0, deadline - time.monotonic())))
        silent = [f"worker{r}" for r, o in enumerate(out) if o is None]
        codes = [p.exitcode for p in procs]
        assert codes == [0] * len(procs) and not silent, (
            f"exit codes {codes}; no report from {silent}; reports {out}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return out


def test_cuda_tensors_travel_both_ways_under_a_device_map(spawn):
    caller, callee = play(spawn)
    assert caller["seen_by_callee"]  # on cuda:0, bytes intact
    assert caller["back"] == ("cuda:0", True)  # the response maps back
    assert caller["small"]
    assert caller["empty"] == ("cuda:0", b"")
    assert caller["view"]  # packed, contiguous, bytes intact
    assert caller["many"]
    assert "cuda_ipc" in caller["channels"]
    # Each CUDA tensor crossed once through a block, one launch per message:
    # 4 + MANY out, 2 + 1 back (below); of the view, only its quarter of its
    # span, packed by the launch; the small ones packed into one block.
    ipc = caller["counters"]["cuda_ipc"]
    assert ipc["segments"] == 4 + agent_worker.MANY
    assert ipc["copied_bytes"] == 2 * (3 << 20) + 100 + (256 << 10) + agent_worker.MANY_BYTES
    assert ipc["launches"] == 5 and ipc["packed"] == agent_worker.MANY
    # The callee landed the MANY tensors in one allocation, so they share a
    # storage, and its reply carries that storage's span as one segment.
    assert caller["callee_counters"]["cuda_ipc"]["segments"] == 2 + 1
    count, offsets = caller["many_storages"]
    assert count == 1 and all(o % 256 == 0 for o in offsets)
    assert sorted(offsets) == offsets and len(set(offsets)) == agent_worker.MANY
    assert caller["devices"] == callee["devices"] == ["cuda:0"]
    assert caller["map"] == {"cuda:0": "cuda:0"} and callee["map"] == {}
    assert "no device map names cuda:0" in callee["unmapped"]
    assert "worker0" in callee["unmapped"]


@pytest.mark.parametrize("ride_ms", ["10", "10000"])
def test_a_release_waits_for_a_ride_only_so_long(spawn, ride_ms):
    """Issue 46: a block's release rides with the receiver's next frame
    rather than costing a frame of its own, but waits for one at most
    TORCH_RPC_EXT_CUDA_RELEASE_RIDE_MS: while a slow function runs, the
    caller's block goes back after 10 ms (default), not when it returns.
    With 10 s, the control: nothing is sent until the response."""
    caller, _ = play_with(spawn, agent_worker.run_release_ride, ride_ms)
    assert caller["len"] == 4096
    releases, frames = caller["during"]
    if ride_ms == "10":
        assert releases == frames == 1
    else:
        assert releases == 1 and frames == 0


@pytest.mark.parametrize("channels,pool", [
    (("cuda_ipc",), False), (("cuda_staged",), False),
    pytest.param(("cuda_ipc",), True, marks=landing_pool_torch)],
                         ids=["cuda_ipc", "cuda_staged", "cuda_ipc-granted"])
def test_a_received_tensor_is_safe_on_a_busy_side_stream(spawn, monkeypatch, channels, pool):
    """`r = rpc_sync(...); acc += r; del r` on a side stream still busy: the
    copy of r runs after the next call landed. Received tensors live in
    torch's caching allocator, allocated on the arrival stream, so the
    future's wait() records them on the side stream and their memory is
    not reused until that stream is done; the channel's own memory (the
    sender's block, a staging block) went back right after the copy into
    them. Before, r viewed the channel's memory, which torch cannot record,
    and the second call overwrote it under the queued copy. The same for
    tensors the peer wrote into memory we granted (docs/cuda.md, "Grants"):
    blocks of the landing pool, torch's memory too, so the grant that
    follows r's is not r's block while the side stream has not passed it."""
    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_LANDING_POOL", "1" if pool else "0")
    caller, _ = play_with(spawn, agent_worker.run_side_stream, channels, False, pool)
    assert all(caller["later"]), caller["later"]
    assert caller["first_intact"]
    landed = caller["landed"]
    segments = landed.pop("rpc_ext.cuda.landing_pool_segments")
    pool_bytes = landed.pop("rpc_ext.cuda.landing_pool_bytes")
    if not pool:
        assert landed == {"rpc_ext.cuda.landed_segments": 2,
                          "rpc_ext.cuda.landed_bytes": 2 << 20,
                          "rpc_ext.cuda.landing_launches": 2,
                          "rpc_ext.cuda.landing_allocations": 2,
                          "rpc_ext.cuda.landing_pool_allocations": 0,
                          "rpc_ext.cuda.granted_segments": 0}
        assert (segments, pool_bytes) == (0, 0)
    else:
        # The first call landed by copy, in torch's default pool; the
        # three after it were written into grants, each followed by the
        # next grant: four blocks of the pool, and none of them landed.
        assert landed == {"rpc_ext.cuda.landed_segments": 1,
                          "rpc_ext.cuda.landed_bytes": 3 << 20,
                          "rpc_ext.cuda.landing_launches": 1,
                          "rpc_ext.cuda.landing_allocations": 1,
                          "rpc_ext.cuda.landing_pool_allocations": 4,
                          "rpc_ext.cuda.granted_segments": 3}
        if REAL_DRIVER:
            assert segments >= 1 and pool_bytes >= 4 << 20  # torch's own sizes
        else:
            # The first granted block, waiting for the side stream, was
            # not taken again (a segment per block on the fake): all four
            # live, each the grant's size (3 MiB rounded up to 2 MiB's).
            assert (segments, pool_bytes) == (4, 4 * (4 << 20))
    if not REAL_DRIVER:
        # The first tensor's free waited for the side stream, so the
        # memory after it was a block of its own.
        assert caller["allocator"]["deferred"] >= 1
        assert caller["allocator"]["skipped_records"] == 0


@landing_pool_torch
def test_two_sizes_have_a_grant_each_and_a_third_takes_the_oldest(spawn, monkeypatch):
    """Grants (docs/cuda.md, "Grants"): a receiver grants the size of a large
    segment that fitted no grant (one holds at most twice its segment), in
    one of two slots per device. Tensors of 2 and 5 MiB taking turns each go
    into a grant from their second call on, both ways, with nothing taken
    back; a third size (12 MiB) makes each receiver revoke its oldest grant
    (kind 38), which the sender gives back unused (kind 39), and its grant
    follows. Before: one grant per device, made the size of the last
    segment, so sizes taking turns each landed by copy."""
    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_LANDING_POOL", "1")
    caller, _ = play_with(spawn, agent_worker.run_grant_growth)
    assert caller["back"] == [True] * len(agent_worker.GROWTH)
    #                           2 MiB, 5 MiB, then in grants; 12 MiB: copy, then grants
    assert caller["granted"] == [(0, 0)] * 2 + [(1, 1)] * 4 + [(0, 0)] + [(1, 1)] * 2
    for ours, theirs in (caller["counters"], caller["counters"][::-1]):
        assert ours["grants_revoked"] == 1 and theirs["grants_returned"] == 1, (ours, theirs)
        assert ours["grants_capped"] == 0, ours


@landing_pool_torch
def test_a_strided_view_is_packed_straight_into_a_grant(spawn, monkeypatch):
    """A strided view's bytes are packed by the sender straight into the
    receiver's grant, as into a block of its own (the received tensor is
    dense either way). Before, views never went into grants, while the
    receiver granted their size after each one: a grant made for nothing,
    held until taken back, and made again."""
    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_LANDING_POOL", "1")
    caller, _ = play_with(spawn, agent_worker.run_grant_view)
    assert caller["back"] == [((1024, 1024), True)] * 3
    assert caller["granted"] == [(0, 0), (1, 1), (1, 1)]


@pytest.mark.skipif(REAL_DRIVER, reason="the fake holds the stream: a GPU races")
@pytest.mark.parametrize("channels", [("cuda_ipc",), ("cuda_staged",)],
                         ids=["cuda_ipc", "cuda_staged"])
@pytest.mark.not_sanitized(
    "its subject is the race zero-copy documents (a view used off its arrival stream while "
    "the next call lands there), which TSan, judging against the fake's stream ordering, "
    "reports as it should", kinds=("thread",))
def test_under_zero_copy_a_view_is_safe_on_its_arrival_stream_only(spawn, channels):
    """cuda_zero_copy's stated rule (docs/guide.md, "Streams"): the view's
    memory is the channel's, which record_stream cannot see, so the same
    sequence reads the second call's bytes. That the test above catches
    the defect rests on this."""
    caller, _ = play_with(spawn, agent_worker.run_side_stream, channels, True)
    assert caller["later"] == [True]
    assert not caller["first_intact"]
    assert caller["landed"] == {"rpc_ext.cuda.landed_segments": 0,
                                "rpc_ext.cuda.landed_bytes": 0,
                                "rpc_ext.cuda.landing_launches": 0,
                                "rpc_ext.cuda.landing_allocations": 0,
                                "rpc_ext.cuda.landing_pool_allocations": 0,
                                "rpc_ext.cuda.granted_segments": 0,
                                "rpc_ext.cuda.landing_pool_segments": 0,
                                "rpc_ext.cuda.landing_pool_bytes": 0}
    assert caller["allocator"]["skipped_records"] >= 1


@pytest.mark.parametrize("legacy", [False, True], ids=["descriptor", "legacy"])
def test_an_idle_block_is_freed_only_after_the_importer_closed_it(spawn, monkeypatch,
                                                                  legacy):
    """Each worker's block goes idle and is dropped (after 5 s). Before, the
    owner destroyed its events (and freed a legacy block's memory) as it
    sent the drop, while the importer still had them open: the importer's
    teardown of its import then used poisoned events (and closed a legacy
    mapping of freed memory), which cuda.h calls undefined. Now the owner
    keeps the block until the importer answers that it closed it."""
    if legacy:
        monkeypatch.setenv("TORCH_RPC_EXT_CUDA_IPC_LEGACY", "1")
    caller, _ = play_with(spawn, agent_worker.run_drop)
    assert caller["back"]
    assert caller["unmapped"] == caller["created"] == (1, 1)
    if not REAL_DRIVER:
        assert caller["poisoned"] == (0, 0)


@pytest.mark.skipif(REAL_DRIVER, reason="the fake's count of poisoned uses")
@pytest.mark.parametrize("legacy", [False, True], ids=["descriptor", "legacy"])
def test_a_graceful_shutdown_frees_each_block_only_after_the_importer_closed_it(
        spawn, monkeypatch, legacy):
    """rpc.shutdown() right after a tensor went there and back: each worker
    holds an import of the other's block. Before, the connections closed and
    each side freed its blocks and closed its imports independently, so one
    worker closed its import after the owner had destroyed the events (2
    poisoned uses in each process, the fake's count). Now, with the group
    idle, each worker drops its blocks and waits for the peer to close them
    before the connections close (Connections::settleChannels)."""
    if legacy:
        monkeypatch.setenv("TORCH_RPC_EXT_CUDA_IPC_LEGACY", "1")
    caller, callee = play_with(spawn, agent_worker.run_shutdown)
    assert caller["back"]
    assert caller["opened"] == callee["opened"] == 0
    assert caller["poisoned"] == callee["poisoned"] == 0


@pytest.mark.parametrize("channels", [("cuda_ipc",), ("cuda_staged",)],
                         ids=["cuda_ipc", "cuda_staged"])
def test_tensors_move_while_a_graph_is_captured_in_global_mode(spawn, channels):
    """While worker0's stream captures a graph in global mode, the agent's
    threads there keep serving CUDA tensors: each of their driver calls runs
    in relaxed capture mode (CurrentDevice), so none is refused and none
    would invalidate the capture. Before, the fake refused the first (a
    block's cuMemCreate or cuMemAlloc, an event query) and the calls
    failed."""
    caller, _ = play_with(spawn, agent_worker.run_capture, channels)
    assert "error" not in caller, caller
    assert caller["pounded"] is True
    if REAL_DRIVER:
        assert caller["graph"]
    else:
        assert caller["violations"] == 0, caller["last_error"]


@pytest.mark.skipif(REAL_DRIVER, reason="the fake's memory limit")
def test_out_of_device_memory_frees_torchs_cache_and_tries_again(spawn, monkeypatch):
    """worker0's device is full, but 10 MiB of it sit in torch's cache:
    cuda_ipc's block fails once, torch frees its cache, the block is made
    and the tensor goes by cuda_ipc. Before, the call failed (cuMemCreate:
    CUDA_ERROR_OUT_OF_MEMORY)."""
    monkeypatch.setenv("FAKE_CUDA_MEM_LIMIT", str(16 << 20))
    caller, _ = play_with(spawn, agent_worker.run_memory, "cache")
    assert caller.get("back") is True, caller
    assert caller["memory"]["oom_retries"] >= 1
    assert caller["allocator"]["emptied"] >= 1
    assert caller["ipc"]["segments"] == 1 and caller["staged"]["segments_sent"] == 0
    assert caller["memory"]["ipc_block_bytes"] == 4 << 20  # one block, 2 MiB granules


@pytest.mark.skipif(REAL_DRIVER, reason="the fake's memory limit")
def test_still_out_of_device_memory_declines_to_the_next_channel(spawn, monkeypatch):
    """Live tensors hold worker0's device: after torch freed its (empty)
    cache the block still does not fit, so cuda_ipc declines the segment;
    cuda_ring, whose snapshot of the tensor needs a device block too,
    declines it as well, and cuda_staged (pinned host memory on the sending
    side) carries it."""
    monkeypatch.setenv("FAKE_CUDA_MEM_LIMIT", str(16 << 20))
    caller, _ = play_with(spawn, agent_worker.run_memory, "held")
    assert caller.get("back") is True, caller
    assert caller["memory"]["oom_retries"] >= 1
    assert caller["memory"]["ipc_declined_memory"] >= 1
    assert caller["ipc"]["segments"] == 0 and caller["ring"]["segments_sent"] == 0
    assert caller["ring"]["declined"] >= 1 and caller["staged"]["segments_sent"] == 1
    assert caller["memory"]["ipc_block_bytes"] == 0


def test_cuda_ipc_memory_limit_bounds_the_blocks(spawn):
    """cuda_ipc_memory_limit=1 MiB: a 3 MiB tensor's block would pass it, so
    cuda_ipc declines and cuda_ring carries the tensor; the metrics say
    so."""
    caller, _ = play_with(spawn, agent_worker.run_memory, "limit")
    assert caller.get("back") is True, caller
    assert caller["memory"]["ipc_declined_memory"] >= 1
    assert caller["memory"]["oom_retries"] == 0
    assert caller["ipc"]["segments"] == 0 and caller["ring"]["segments_sent"] == 1


@pytest.mark.skipif(REAL_DRIVER, reason="the fake's driver version")
def test_cuda_tensors_move_on_an_older_driver_without_numba(spawn, monkeypatch, tmp_path):
    """A CUDA 12.0 driver (R525) and no numba-cuda: the kernels the package
    ships (PTX ISA 6.0) load, and nothing imports numba. Before, init_rpc
    compiled them with numba-cuda (an ImportError without it) into ISA 9.0,
    which a driver older than CUDA 13.0 refuses."""
    monkeypatch.setenv("FAKE_CUDA_DRIVER_VERSION", "12000")
    shim = tmp_path / "shim" / "numba"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('no numba here (a test)')\n")
    # On sys.path, not PYTHONPATH: a child's sys.path is its parent's (spawn's
    # preparation data), whatever PYTHONPATH its interpreter started with.
    monkeypatch.syspath_prepend(str(tmp_path / "shim"))
    caller, callee = play(spawn)
    assert caller["seen_by_callee"] and caller["back"] == ("cuda:0", True)
    assert caller["many"] and caller["view"]
    assert not caller["numba_loaded"] and not callee["numba_loaded"]
    # ... and numba was not there to load: each found only the shim.
    assert caller["numba_origin"].startswith(str(shim)), caller["numba_origin"]
    assert callee["numba_origin"].startswith(str(shim)), callee["numba_origin"]


@pytest.mark.skipif(REAL_DRIVER, reason="counts the fake's contexts")
def test_a_process_holds_contexts_on_the_devices_it_uses_only(spawn, monkeypatch):
    """On a node of four devices, workers that move tensors of cuda:0 by
    cuda_ipc hold a primary context there and nowhere else (each costs
    memory on its GPU, and an EXCLUSIVE_PROCESS device refuses a second
    process's)."""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "4")
    caller, callee = play(spawn)
    assert caller["seen_by_callee"] and caller["back"] == ("cuda:0", True)
    assert caller["counters"]["cuda_ipc"]["segments"] > 0
    for worker in (caller, callee):
        assert worker["retains"][0] >= 1 and worker["retains"][1:] == [0, 0, 0], worker["retains"]


def test_cuda_tensors_travel_through_legacy_ipc_handles(spawn, monkeypatch):
    """Both workers publish legacy handles only (as where a device cannot
    export descriptors): the same calls, each tensor copied out of the
    sender's block on arrival into the receiver's own memory."""
    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_IPC_LEGACY", "1")
    caller, _ = play(spawn)
    assert caller["seen_by_callee"] and caller["back"] == ("cuda:0", True)
    assert caller["small"] and caller["view"] and caller["many"]
    assert caller["empty"] == ("cuda:0", b"")
    ipc = caller["counters"]["cuda_ipc"]
    assert ipc["segments"] == 4 + agent_worker.MANY
    assert ipc["blocks_legacy"] == ipc["blocks_created"] > 0
    # What came back (2 tensors, and the MANY in the one storage the callee
    # landed them in) was copied out of the callee's blocks.
    assert ipc["copied_out"] == 2 + 1
    assert caller["callee_counters"]["cuda_ipc"]["copied_out"] == 4 + agent_worker.MANY


@pytest.mark.parametrize(
    "channels,target,transports",
    [
        (("cuda_staged",), 0, ("tcp",)),
        pytest.param(("cuda_staged",), 1, ("tcp",), marks=two_devices),
        pytest.param(("cuda_ipc", "cuda_staged"), 1, None, marks=two_devices),
    ],
    ids=["tcp-same-device", "tcp-other-device", "shm-other-device-ipc-declines"],
)
def test_cuda_tensors_staged_through_host_memory(spawn, monkeypatch, channels, target,
                                                 transports):
    """cuda_staged over TCP (as between hosts); with two devices that cannot
    reach each other peer to peer, a map from cuda:0 to the peer's cuda:1,
    which cuda_ipc declines (the peer's cuda:1 cannot read a block of
    cuda:0) and cuda_staged carries."""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    monkeypatch.setenv("FAKE_CUDA_NO_PEER_ACCESS", "1")
    caller, callee = play(spawn, channels, target, transports)
    assert caller["seen_by_callee"]  # on cuda:<target>, bytes intact
    assert caller["back"] == ("cuda:0", True)  # through the reverse map
    assert caller["small"]
    assert caller["empty"] == (f"cuda:{target}", b"")
    assert caller["view"]  # packed on the device, then staged
    assert caller["many"]  # gathered by one launch, then staged
    assert "cuda_staged" in caller["channels"]
    # Tensors with bytes out: 3 MiB, 3 MiB, 100 B, MANY small ones, a 256 KiB
    # view of 1 MiB; back: 3 MiB, 100 B and the MANY in the one storage the
    # callee landed them in.
    n = agent_worker.MANY
    staged = caller["counters"]["cuda_staged"]
    assert staged["segments_sent"] == 4 + n and staged["segments_received"] == 2 + 1
    assert staged["bytes_sent"] == 2 * (3 << 20) + 100 + (256 << 10) + agent_worker.MANY_BYTES
    assert staged["packed"] == 1 and staged["gathered"] == n
    theirs = caller["callee_counters"]["cuda_staged"]
    # (Its reply had one segment for the MANY: nothing to gather.)
    assert theirs["segments_received"] == 4 + n and theirs["gathered"] == 0
    if "cuda_ipc" in channels:
        assert caller["counters"]["cuda_ipc"]["segments"] == 0
        assert caller["counters"]["cuda_ipc"]["declined"] == 4 + n
    assert caller["devices"] == ["cuda:0"] and callee["devices"] == [f"cuda:{target}"]
    assert caller["map"] == {"cuda:0": f"cuda:{target}"}
    assert "worker0" in callee["unmapped"]


@pytest.mark.parametrize(
    "channels,target",
    [
        (("cuda_ring", "cuda_staged"), 0),
        pytest.param(("cuda_ipc", "cuda_ring", "cuda_staged"), 1, marks=two_devices),
    ],
    ids=["same-device", "other-device-ipc-declines"],
)
def test_large_cuda_tensors_go_through_a_shared_pinned_ring(spawn, monkeypatch, channels,
                                                             target):
    """On one host, where cuda_ipc does not join the two devices (listed
    without it; or two devices without peer access, which cuda_ipc
    declines), tensors of 1 MiB or more go through cuda_ring: the sender
    copies each 4 MiB chunk out of its device into a slot of a pinned memfd
    ring both processes registered, the receiver copies the slot onto its
    device and releases it through the ring's header. A 40 MiB tensor
    reuses the 8 slots within itself; a strided view is packed as it is
    copied at the send; four 12 MiB calls at once wait on
    both directions' releases at the same time. Nothing goes through
    cuda_staged (the socket), and no copy reads or writes pageable memory
    (the fake counts copies whose host side is neither cuMemHostAlloc's nor
    registered)."""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    monkeypatch.setenv("FAKE_CUDA_NO_PEER_ACCESS", "1")
    # One ring per direction for the whole test: a ring unused for the
    # default 5 s is dropped and made again, which a loaded host's pause
    # between two calls (copies run 50 ms late here) could reach.
    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_RING_IDLE_MS", "600000")
    caller, _ = play_with(spawn, agent_worker.run_ring, channels, target)
    assert "error" not in caller, caller.get("error")
    assert caller["back"] == [("cuda:0", True)] * len(agent_worker.RING_SIZES)
    assert caller["concurrent"] == [True] * agent_worker.RING_CONCURRENT
    assert caller["view"] == ((1024, 512), True)
    ours, theirs = caller["counters"]["cuda_ring"], caller["callee_counters"]["cuda_ring"]
    view = agent_worker.RING_VIEW_SPAN // 2
    total = sum(agent_worker.RING_SIZES) + view + (
        agent_worker.RING_CONCURRENT * agent_worker.RING_CONCURRENT_BYTES)
    calls = len(agent_worker.RING_SIZES) + 1 + agent_worker.RING_CONCURRENT
    assert ours["segments_sent"] == theirs["segments_received"] == calls
    assert theirs["segments_sent"] == ours["segments_received"] == calls
    assert ours["bytes_sent"] == theirs["bytes_received"] == total
    assert ours["made"] == theirs["made"] == 1  # one ring per direction
    chunks = sum(-(-n // (4 << 20)) for n in agent_worker.RING_SIZES) + 1 + (
        agent_worker.RING_CONCURRENT * 3)
    assert ours["chunk_copies"] == theirs["chunk_copies"] == 2 * chunks  # out and in
    assert ours["declined"] == theirs["declined"] == 0
    staged = caller["counters"]["cuda_staged"]
    assert staged["segments_sent"] == staged["segments_received"] == 0
    if not REAL_DRIVER:
        assert caller["pageable"] == caller["callee_pageable"] == 0


def test_an_idle_ring_is_dropped_and_made_again_when_needed(spawn, monkeypatch):
    """A ring unused past TORCH_RPC_EXT_CUDA_RING_IDLE_MS with every slot
    released is dropped (kRingDrop: the peer unmaps and unregisters it
    too); the next large tensor makes a new one, which the peer accepts
    after the drop."""
    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_RING_IDLE_MS", "300")
    caller, _ = play_with(spawn, agent_worker.run_ring_idle)
    assert caller["back"] == [True, True], caller
    for side in ("ours", "theirs"):
        first, last = caller[side]
        assert (first["made"], first["dropped"]) == (1, 1), caller
        assert (last["made"], last["dropped"]) == (2, 2), caller
        assert last["segments_sent"] == last["segments_received"] == 2


@fake_only  # a slow cuMemAlloc (fake_cuda_set_alloc_delay_ms)
def test_a_ring_is_not_dropped_while_a_segment_is_set_up_for_it(spawn, monkeypatch):
    """A ring idle past TORCH_RPC_EXT_CUDA_RING_IDLE_MS (here 0) is dropped
    on a tick, unless a segment may still use it: counted from when the
    segment is first taken for it, not once its snapshot is queued.
    Before, a tick between the two (here: a slow staging allocation)
    dropped the ring under the segment, and its frame failed ("a chunk
    with no ring to carry it"), closing the connection."""
    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_RING_IDLE_MS", "0")
    caller, _ = play_with(spawn, agent_worker.run_ring_dropped_while_set_up)
    assert caller["back"] == [True, True], caller
    assert caller["ours"]["segments_sent"] == 2, caller
    assert caller["ours"]["made"] == 2, caller


@pytest.mark.parametrize("encryption", ["off", "always"])
def test_large_cuda_tensors_across_hosts_go_over_the_lanes(spawn, encryption):
    """Between hosts (TCP, tcp_lanes on), a CUDA tensor of 1 MiB or more is
    copied out of its device by cuda_staged chunk by chunk, and the lanes
    write each stripe as its chunks complete (the fake completes copies
    late: a stripe written before its copy would carry stale bytes); the
    receiver lands the lanes' host memory on its device. The connection's
    stream carries 16-byte records only."""
    from tests.cuda_driver import lanes_worker

    caller, _ = play_with(spawn, lanes_worker.run, encryption)
    assert "error" not in caller, caller.get("error")
    assert caller["lanes_up"], repr(caller)
    assert caller["back"] == [("cuda:0", True)] * len(lanes_worker.SIZES)
    assert caller["view"] == ((1024, 512), True)
    assert caller["concurrent"] == [True] * lanes_worker.CONCURRENT
    calls = len(lanes_worker.SIZES) + 1 + lanes_worker.CONCURRENT

    def delta(channel, side, key):
        return caller["after"][channel][side][key] - caller["before"][channel][side][key]

    for side in (0, 1):  # worker0's requests, worker1's answers
        # Every one copied out by cuda_staged and striped over the lanes;
        # none landed by cuda_staged (the stream carried records only).
        assert delta("tcp_lanes", side, "staged_segments") == calls, repr(caller)
        assert delta("cuda_staged", side, "segments_sent") == calls, repr(caller)
        assert delta("cuda_staged", side, "segments_received") == 0, repr(caller)
    sent = delta("cuda_staged", 0, "bytes_sent")
    assert sent == delta("tcp_lanes", 0, "bytes") == delta("tcp_lanes", 1, "bytes")


@fake_only  # the fake's kernel delay
@pytest.mark.parametrize("encryption", ["off", "always"])
def test_lanes_waiting_for_a_slow_device_copy_keep_the_held_record_alive(spawn, encryption):
    """A stripe waits for its bytes to be copied out of the device (two
    chunks, 3 s each; heartbeat_timeout 1 s) while the receiver holds its
    record: the lane sends keepalive chunks meanwhile, so the receiver
    does not take it for stalled (which closes the connection after two
    heartbeat_timeouts of quiet lanes), and the call comes back intact."""
    from tests.cuda_driver import lanes_worker

    caller, _ = play_with(spawn, lanes_worker.run_slow_copy, encryption, 3000, 1.0)
    assert caller["lanes_up"], caller
    assert caller.get("back") is True, caller
    ours, theirs = caller["lanes"]
    assert ours["keepalives"] >= 6 and ours["staged_segments"] >= 1, caller
    assert theirs["stalls"] == 0 and theirs["held_records"] >= 1, caller


@fake_only
def test_a_failed_copy_out_stops_the_lanes_waiting_for_it(spawn):
    """A copy out of the device that fails while the lanes wait for its
    bytes (the fake faults the third chunk of 40 MiB): the lane threads
    stop waiting, the connection closes naming the failed copy, the call
    fails with it, and the next calls go over a new connection."""
    from tests.cuda_driver import lanes_worker

    caller, _ = play_with(spawn, lanes_worker.run_failed_copy)
    assert caller["lanes_up"], caller
    # (Said by cuda_staged closing the connection, or by the lane that
    # stopped waiting, whichever comes first.)
    assert "copying a segment out of its device failed" in caller["error"], caller
    assert caller["after"], caller


@two_devices
def test_a_map_between_two_devices_goes_peer_to_peer(spawn, monkeypatch):
    """A map from cuda:0 to the peer's cuda:1 on one node whose devices reach
    each other (NVLink; the fake's default): cuda_ipc lends a block of cuda:0,
    the peer opens it to its cuda:1 (cuMemSetAccess) and lands it there by a
    kernel of cuda:1 reading cuda:0's memory, and the answers come back the
    same way through the reverse map. Nothing goes through host memory. (The
    fake's copy kernels refuse memory their device was not granted, and it
    refuses a grant between devices without peer access.)"""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    caller, callee = play(spawn, ("cuda_ipc", "cuda_staged"), 1)
    assert caller["seen_by_callee"]  # on cuda:1, bytes intact
    assert caller["back"] == ("cuda:0", True)  # through the reverse map
    assert caller["small"] and caller["view"] and caller["many"]
    assert caller["empty"] == ("cuda:1", b"")
    n = agent_worker.MANY
    ipc = caller["counters"]["cuda_ipc"]
    assert ipc["segments"] == 4 + n and ipc["declined"] == 0
    assert caller["callee_counters"]["cuda_ipc"]["segments"] == 2 + 1
    for counters in (caller["counters"], caller["callee_counters"]):
        assert counters["cuda_staged"]["segments_sent"] == 0
    assert caller["devices"] == ["cuda:0"] and callee["devices"] == ["cuda:1"]
    assert caller["map"] == {"cuda:0": "cuda:1"}


def run_alone(spawn, target, *args):
    """TARGET(port, pipe, *ARGS) in a spawned process of its own (a world of
    one): what it sent down the pipe, once it exited with 0 and no error."""
    ours, theirs = spawn.Pipe()
    proc = spawn.Process(target=target, args=(free_port(), theirs, *args))
    (out,) = gather([proc], [(ours, theirs)])  # fails at once if it dies
    assert "error" not in out, out["error"]
    return out


@pytest.mark.parametrize("zero_copy", [False, True], ids=["landed", "zero_copy"])
def test_cuda_tensors_sent_to_ones_own_worker(spawn, zero_copy):
    """A worker's calls to itself go over a connection to itself, where the
    driver refuses the process's own IPC handles (the fake too): cuda_ipc
    declines such a peer, and cuda_self copies each frame's tensors into
    one pooled block on the device (no host memory, nothing in the socket
    but records), which the receiver lands from or, under cuda_zero_copy,
    views: never the sender's own memory."""
    out = run_alone(spawn, agent_worker.run_self, zero_copy)
    assert out["seen"] and out["back"] == ("cuda:0", True)
    assert out["distinct"] and out["view"] and out["many"]
    assert out["counters"]["cuda_ipc"]["segments"] == 0
    assert out["counters"]["cuda_staged"]["segments_sent"] == 0
    # Sent by this one agent, caller and callee: 3 MiB out with each call
    # and back with identity's answer, the view out, MANY out and back
    # (landed, as one segment: they share the storage they landed in).
    self_counts = out["counters"]["cuda_self"]
    sent = 3 + 1 + agent_worker.MANY + (agent_worker.MANY if zero_copy else 1)
    assert self_counts["segments_sent"] == self_counts["segments_received"] == sent
    # One launch per frame with tensors (six): the view's is its packing.
    assert self_counts["launches"] == 6
    assert self_counts["declined"] == 0


def test_a_function_registered_by_name_runs_after_its_cuda_tensors_landed(spawn):
    """A function served by name (torch_rpc_ext.scripting) runs under the
    streams its CUDA arguments arrived on, as a Python UDF does: reading an
    argument in order after the current stream sees its bytes even though
    they landed 50 ms late, and a tensor it returns is sent after its
    landing. Before, it ran on streams ordered after nothing: it read the
    landing memory before the landing copy, and its answer went out
    before it."""
    caller, _ = play_with(spawn, agent_worker.run_named)
    assert caller["udf"]
    assert caller["named"]
    assert caller["named_back"] == ("cuda:0", True)
    assert "returned value 0 on cpu: a call from torch.compile returns its tensors " \
        "on the device of its tensor arguments (cuda:0)" in caller["compiled_on_host"]


@two_devices
def test_a_function_that_changes_the_current_device_leaves_the_serving_thread_as_it_was(
        spawn, monkeypatch):
    """A function served with devices may call torch.cuda.set_device(1)
    and return: the next function served on that thread still finds the
    thread's own device (torch's invokeCallback restores it around the
    callback requests ran in before session 63 served them in one
    future)."""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    caller, _ = play_with(spawn, agent_worker.run_device_left)
    assert caller["seen"] == [0] * 24, caller


def test_a_traced_call_shows_its_cuda_tensors_landing(spawn):
    """OpenTelemetry (torch_rpc_ext.tracing, docs/observability.md): a
    request's CUDA tensors landing on the callee is an rpc.land span under
    the function's rpc.serve span, in the caller's trace; a request with
    CPU tensors only has none."""
    pytest.importorskip("opentelemetry.sdk", reason="needs opentelemetry-sdk")
    out = run_alone(spawn, agent_worker.run_traced_self)
    assert out["seen"] and out["cpu"]
    spans = out["spans"]
    step = next(s for s in spans if s["name"] == "step")
    (serve,) = [s for s in spans if s["name"] == "rpc.serve describe"]
    lands = [s for s in spans if s["name"] == "rpc.land"]
    assert len(lands) == 1, spans  # describe's request; layout's had no CUDA tensor
    assert lands[0]["parent"] == serve["id"] and lands[0]["trace"] == step["trace"]
    assert lands[0]["start"] <= lands[0]["end"] <= serve["end"]


@fake_only
def test_a_device_without_interprocess_events_is_not_offered_to_cuda_ipc(spawn, monkeypatch):
    """A device that exports memory but has no interprocess events (vGPU,
    WSL, confidential computing: CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED is
    0) would fail every cuda_ipc block: cuda_ipc is not offered at all, and
    cuda_staged carries the tensors."""
    monkeypatch.setenv("FAKE_CUDA_NO_IPC_EVENTS", "1")
    caller, _ = play(spawn, ("cuda_ipc", "cuda_staged"))
    assert caller["seen_by_callee"] and caller["back"] == ("cuda:0", True)
    assert caller["small"] and caller["view"] and caller["many"]
    assert "cuda_staged" in caller["channels"] and "cuda_ipc" not in caller["channels"]
    assert caller["counters"]["cuda_staged"]["segments_sent"] == 4 + agent_worker.MANY


def test_device_maps_in_a_dynamic_group(spawn, tmp_path):
    """A member of a dynamic group maps its CUDA tensors to a member that
    receives on that device; a joiner whose map lands on a device the
    member does not receive on is refused before it joins, and the group
    takes the next joiner."""
    gates = {k: spawn.Event() for k in ("0", "2", "done")}
    pipes = [spawn.Pipe() for _ in range(3)]
    store = str(tmp_path / "store")
    procs = [spawn.Process(target=agent_worker.run_dynamic,
                           args=(rank, store, pipes[rank][1], gates)) for rank in range(3)]
    w0, w1, w2 = gather(procs, pipes)
    assert w2["gate0"] and w1["gate2"] and w0["done_gate"], (w0, w1, w2)
    assert "worker2 maps its cuda:0 to cuda:1 of worker0" in w2["refused"]
    assert "[cuda:0] only" in w2["refused"]
    assert w1["seen_by_worker0"]
    assert w1["back"] == ("cuda:0", True)  # through worker0's reverse map
    assert "cuda_ipc" in w1["channels"]
    assert w0["devices"] == ["cuda:0"]
    assert w0["counters"]["segments"] == 1  # the answer, by cuda_ipc
