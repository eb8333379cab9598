# SPDX-License-Identifier: BSD-3-Clause
"""cuda_ipc over legacy IPC handles (cuIpcGetMemHandle), its fallback where a
device cannot export memory as a file descriptor. A legacy block dies with
its owner, so the receiver copies each segment out into memory of its own
and releases the block at once (docs/cuda.md). TORCH_RPC_EXT_CUDA_IPC_LEGACY=1
makes a process publish legacy handles only, so these tests take that path
on the fake and on a GPU that has both; FAKE_CUDA_NO_VMM=1 makes the fake a
device without descriptors."""

import pytest

from tests.cuda_driver import closed_worker, ipc_worker
from tests.cuda_driver.conftest import REAL_DRIVER, fake_only
from tests.cuda_driver.test_ipc_channel import play

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("slow_kernels")]


@pytest.fixture
def legacy(monkeypatch):
    monkeypatch.setenv("TORCH_RPC_EXT_CUDA_IPC_LEGACY", "1")


def test_sharing_is_by_descriptor_where_both_can_else_legacy_in_one_pid_namespace():
    from torch_rpc_ext._testing import cuda

    a, b = "a" * 32, "b" * 32
    both = f"boot;{a},{b};pid:[1]"
    assert cuda.ipc_sharing(both, both, a) == "fd"
    # One end has legacy handles only for `a`: legacy both ways.
    mixed = f"boot;~{a},-;pid:[1]"
    assert cuda.ipc_sharing(both, mixed, a) == cuda.ipc_sharing(mixed, both, a) == "legacy"
    # `b` is not shared by the other end; another PID namespace or another
    # host reaches nothing without descriptors.
    assert cuda.ipc_sharing(both, mixed, b) is None
    assert cuda.ipc_sharing(both, f"boot;~{a};pid:[2]", a) is None
    assert cuda.ipc_sharing(both, f"boot;{a};pid:[2]", a) == "fd"
    assert cuda.ipc_sharing(both, f"other;{a};pid:[1]", a) is None
    # A descriptor without a PID namespace (an older peer) has fd blocks only.
    assert cuda.ipc_sharing(both, f"boot;{a}", a) == "fd"
    assert cuda.ipc_sharing(mixed, f"boot;{a}", a) is None
    # The same process (a worker's calls to itself): its own IPC handles do
    # not open in it, so nothing, whatever it could share with another.
    me = f"boot;{a},{b};pid:[1];42"
    assert cuda.ipc_sharing(me, me, a) is None
    assert cuda.ipc_sharing(me, f"boot;{a},{b};pid:[1];43", a) == "fd"
    assert cuda.ipc_sharing(me, f"boot;{a},{b};pid:[2];42", a) == "fd"
    # After a descriptor device's UUID, the devices that read it peer to
    # peer (an NVLink node: a map {0: 1} goes by cuda_ipc); what is not an
    # index is ignored, and a legacy device lists none.
    nvlink = f"boot;{a}+1+2,{b}+0,~{a}+1;pid:[1];42"
    assert cuda.ipc_domain(nvlink) == (f"boot;{a}+1+2,{b}+0,~{a};pid:[1];42", [[1, 2], [0], []])
    assert cuda.ipc_domain(f"boot;{a}+x+-1+99999+3;p;1") == (f"boot;{a}+3;p;1", [[3]])
    assert cuda.ipc_sharing(both, nvlink, a) == "fd"


def test_a_held_view_keeps_its_descriptor_block_lent(spawn):
    sender, (intact, receiver) = play(spawn, "kept")
    assert intact == (True, True)
    assert sender["blocks_created"] == 2 and sender["blocks_legacy"] == 0
    assert receiver["copied_out"] == 0


@pytest.mark.usefixtures("legacy")
def test_legacy_segments_are_copied_out_and_their_block_released_at_once(spawn):
    sender, (intact, receiver) = play(spawn, "kept")
    # The first view keeps its bytes though its block carried the second.
    assert intact == (True, True)
    assert sender["blocks_created"] == sender["blocks_legacy"] == 1
    assert sender["segments"] == 2 and receiver["blocks_imported"] == 1
    assert receiver["copied_out"] == 2


@pytest.mark.usefixtures("legacy")
def test_legacy_blocks_are_pooled(spawn):
    sender, (seen, receiver) = play(spawn, "pooled")
    assert seen == [
        (b"m%d" % i, n, ipc_worker.DEVICE, True) for i, n in enumerate(ipc_worker.SIZES)
    ]
    assert sender["blocks_created"] == sender["blocks_legacy"] == 2
    assert receiver["blocks_imported"] == 2
    assert receiver["copied_out"] == 4


@pytest.mark.usefixtures("legacy")
def test_a_segment_copied_out_of_a_legacy_block_outlives_its_sender(spawn):
    _, (intact, closed) = play(spawn, "outlives", after_sender_exits="exited")
    assert intact and closed


@pytest.mark.usefixtures("legacy")
def test_a_packed_legacy_block_is_released_after_its_last_segment(spawn):
    (back_ok, first, sender), (seen, imported, receiver) = play(spawn, "gathered")
    n = len(ipc_worker.GATHERED)
    assert [(head, intact) for head, intact, _, _ in seen] == [(b"g0", True), (b"g1", True)]
    assert (first["blocks_created"], first["launches"], first["packed"]) == (2, 1, n)
    assert first["blocks_legacy"] == 2 and imported == 2
    # The region sent back is the receiver's own memory: copied, not handed back.
    assert back_ok == (b"back", True)
    assert receiver["handbacks"] == 0 and receiver["segments"] == 1
    # Frame two reuses both blocks: each was released after the frame's last
    # segment in it was copied out.
    assert sender["blocks_created"] == 2 and sender["segments"] == 2 * (n + 1)
    assert receiver["copied_out"] == 2 * (n + 1)


@pytest.mark.usefixtures("legacy")
def test_a_frame_whose_copies_out_are_never_marked_last_is_refused(spawn):
    (got_s, sender), (got, reason, receiver) = play(spawn, "unmarked")
    assert got is None and got_s is None  # nothing delivered either way
    assert "not copied out" in reason and "CUDA block" in reason
    assert sender["blocks_legacy"] == 1 and receiver["copied_out"] == 0


@pytest.mark.skipif(REAL_DRIVER, reason="FAKE_CUDA_NO_VMM is the fake's")
def test_a_device_without_descriptor_export_shares_by_legacy_handles(spawn, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_NO_VMM", "1")
    sender, (seen, receiver) = play(spawn, "pooled")
    assert all(ok for *_, ok in seen)
    assert sender["blocks_legacy"] == 2 and receiver["copied_out"] == 4


@pytest.mark.skipif(REAL_DRIVER, reason="FAKE_CUDA_MEM_LIMIT is the fake's")
@pytest.mark.usefixtures("legacy")
def test_no_memory_to_copy_a_legacy_segment_out_into_fails_its_message_only(spawn):
    """A legacy segment is copied out into memory of the receiver's own; where
    there is none to be had, the message fails (a failed region: the
    agent fails its call, docs/cuda.md), not the connection, which the
    peer did nothing to deserve. The block is still released, and the next
    message lands. Before, the connection closed ("copying segments out of
    the peer's CUDA block ... failed") and the next message never came."""
    (head, sender), (first, second, reason, receiver) = play(spawn, "legacy_oom")
    big, failed = first
    assert big == b"big" and failed.startswith("failed: no memory on cuda:0"), failed
    assert second == (b"small", True) and head == b"r1"
    assert reason == ""
    assert receiver["copy_outs_failed"] == 1 and receiver["copied_out"] == 1
    assert sender["blocks_legacy"] >= 1


@fake_only
@pytest.mark.usefixtures("legacy")
def test_a_dead_peers_legacy_block_stays_mapped_while_our_copy_out_of_it_waits(spawn):
    """The peer dies after sending a segment in a legacy block, before its
    copy into the block ran: `ready` never completes, so our copy out, queued
    behind it, never runs. The block's mapping stays (it is named in the log
    after 10 s); before, it was closed at the channel's 2 s deadline, under
    the queued copy (on the fake the close then waited for every stream, the
    staging thread with it, for ever). And the landing that copy was to fill
    is not handed to the next message: the device's pool keeps it until its
    last use completes."""
    (ok_s, sender), (ok_r, baseline, during, after, reason, landed, receiver) = play(
        spawn, "legacy_late", worker=closed_worker)
    assert ok_s and ok_r
    assert sender["blocks_legacy"] == 1 and receiver["blocks_imported"] == 1, (sender, receiver)
    counts = dict(zip(closed_worker.IPC_KEYS, zip(baseline, during, after)))
    assert counts["ipc_mem_mappings"][1] == counts["ipc_mem_mappings"][0] + 1, counts
    assert reason.startswith("peer closed the connection"), reason
    assert counts["ipc_mem_mappings"][2] == counts["ipc_mem_mappings"][1], counts
    # Our landing for it never landed; its block is not reused until its
    # last use completes, so the next landing of that size does not wait
    # behind it (before, it waited for ever).
    assert landed


@fake_only
@pytest.mark.usefixtures("legacy")
def test_our_legacy_block_outlives_the_close_while_a_live_peer_copies_out_of_it(spawn):
    """The connection closes while the peer, alive, still has its copy out
    of our legacy block queued (the fake runs it 6 s late). The block stays
    past the channel's 2 s deadline until that copy ran, then goes; the
    peer's import closes with the memory still ours. Before, the block was
    freed at the deadline, under the peer's copy (its later close of the
    mapping a poisoned use: the order cuda.h leaves undefined, on a GPU a
    read of memory another allocation may have by then)."""
    (ok_s, baseline, with_block, held, after, freed_in), receiver = play(
        spawn, "legacy_slow", worker=closed_worker)
    ok_r, intact, reason, unmapped, poisoned, counters = receiver
    assert ok_s and ok_r and intact and unmapped
    assert counters["blocks_imported"] == 1, counters
    assert reason.startswith("peer closed the connection"), reason
    alloc = closed_worker.IPC_KEYS.index("allocations")
    assert with_block[alloc] > baseline[alloc], (baseline, with_block)
    assert held[alloc] == with_block[alloc], (with_block, held)
    assert after == baseline, (baseline, after)
    assert poisoned == 0
    assert freed_in > closed_worker.SLOW_COPY_MS / 1000 - 1, freed_in


@fake_only
@pytest.mark.usefixtures("legacy")
def test_our_legacy_block_goes_at_the_deadline_when_the_peer_copying_out_of_it_died(spawn):
    """As above, but the peer is killed with its copy out (and `released`)
    pending: a dead process's records never complete, so the block goes at
    the deadline, not when that copy would have run (the peer's process is
    watched through a pidfd)."""
    (ok_s, baseline, with_block, held, after, freed_in), (ok_r, counters) = play(
        spawn, "legacy_gone", worker=closed_worker)
    assert ok_s and ok_r and counters["blocks_imported"] == 1, counters
    alloc = closed_worker.IPC_KEYS.index("allocations")
    assert with_block[alloc] > baseline[alloc], (baseline, with_block)
    assert after == baseline, (baseline, after)
    assert freed_in < closed_worker.SLOW_COPY_MS / 1000, freed_in


@fake_only
@pytest.mark.usefixtures("legacy")
def test_our_legacy_block_lent_at_the_close_waits_for_a_live_peer_to_read_its_frame(spawn):
    """The peer is stopped (SIGSTOP) when we send a segment in a legacy
    block and close: the frame waits unread in its socket, and `released`,
    as it was before the frame, reads done. Past the 2 s deadline the block
    stays (the peer lives, and has not been seen copying out of it); once
    the peer runs again it reads the frame (what came before a close is
    delivered) and copies the segment out of memory still ours. Before,
    the block was freed at the deadline, and the peer's import of it failed."""
    (copied, baseline, with_block, held, after, _), receiver = play(
        spawn, "legacy_unread", worker=closed_worker)
    ok, intact, reason, unmapped, poisoned, counters = receiver
    alloc = closed_worker.IPC_KEYS.index("allocations")
    assert with_block[alloc] > baseline[alloc], (baseline, with_block)
    assert held[alloc] == with_block[alloc], (with_block, held)
    assert ok and intact and copied, (reason, counters)
    assert unmapped and poisoned == 0 and counters["blocks_imported"] == 1, counters
    assert reason.startswith("peer closed the connection"), reason
    assert after == baseline, (baseline, after)
