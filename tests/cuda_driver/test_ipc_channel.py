# SPDX-License-Identifier: BSD-3-Clause
"""The cuda_ipc channel through the channel seam: two processes, one shm
connection each way with no agent above it (_testing.Endpoint), device
memory of the driver under test (the fake here, the GPU's on a GPU
machine). What passes against the fake proves the protocol (setup frames
with descriptors, events, pooling, hand-back, lifetimes), not the hardware:
docs/cuda.md says which is which."""

import os
import signal
import time

import pytest

from tests.cuda_driver import closed_worker, ipc_worker
from tests.cuda_driver.conftest import fake_only, report

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("slow_kernels")]


def play(spawn, scenario: str, after_sender_exits=None, worker=ipc_worker):
    """Runs both ends of `scenario` (of `worker`); returns (sender's
    results, receiver's)."""
    conn_s, conn_r = spawn.Pipe()
    ctl_s, ctl_s_child = spawn.Pipe()
    ctl_r, ctl_r_child = spawn.Pipe()
    sender = spawn.Process(target=worker.run, args=("sender", conn_s, ctl_s_child, scenario))
    receiver = spawn.Process(target=worker.run, args=("receiver", conn_r, ctl_r_child, scenario))
    sender.start()
    receiver.start()
    try:
        out_s = report(sender, ctl_s, "sender")
        if after_sender_exits is not None:
            sender.join(120)
            assert sender.exitcode == 0
            ctl_r.send(after_sender_exits)
        out_r = report(receiver, ctl_r, "receiver")
        for p in (sender, receiver):
            p.join(120)
        assert (sender.exitcode, receiver.exitcode) == (0, 0)
        return out_s, out_r
    finally:
        for p in (sender, receiver):
            if p.is_alive():
                # Its Python stacks to stderr (ipc_worker.run), then gone.
                os.kill(p.pid, signal.SIGUSR1)
                time.sleep(0.5)
                p.kill()
                p.join(10)


def test_segments_travel_in_one_pooled_block(spawn):
    sender, (seen, receiver) = play(spawn, "pooled")
    assert seen == [
        (b"m%d" % i, n, ipc_worker.DEVICE, True) for i, n in enumerate(ipc_worker.SIZES)
    ]
    # Two blocks made, exported and mapped once each, each reused after its
    # release.
    assert sender["blocks_created"] == 2
    assert sender["segments"] == 4
    assert sender["copied_bytes"] == sum(ipc_worker.SIZES)
    assert receiver["blocks_imported"] == 2
    assert sender["declined"] == receiver["declined"] == 0


def test_a_received_view_outlives_its_sender(spawn):
    _, (intact, closed) = play(spawn, "outlives", after_sender_exits="exited")
    assert intact  # read after the sender freed its side, closed and exited
    assert closed  # and the connection is gone


def test_our_blocks_events_outlast_a_close_the_peer_had_no_time_to_answer(spawn):
    """A block of ours left by a close (the peer still held its import) keeps
    its interprocess events until the channel's deadline (2 s): the peer
    destroys its opened copies as its own close retires the import, and
    cuda.h leaves that undefined once the exporter destroyed them. Before,
    they went as soon as our own work on the block was done (the fake saw it
    now and then when both ends closed at once)."""
    _, (intact, poisoned) = play(spawn, "closed_while_held", after_sender_exits="exited")
    assert intact
    assert poisoned in (None, 0)


def test_a_block_sent_back_unchanged_is_handed_back_without_a_copy(spawn):
    (back, sender), receiver = play(spawn, "handback")
    head, size, intact = back
    assert (head, intact) == (b"back", True)
    assert size >= 1 << 20
    assert receiver["handbacks"] == 1 and receiver["copied_bytes"] == 0
    assert receiver["blocks_created"] == 0
    # The handed-back block, freed by the sender, carries its next segment.
    assert sender["blocks_created"] == 1 and sender["segments"] == 2


def test_a_block_lent_again_while_a_handed_back_view_lives_is_released(spawn):
    sender, (intact, receiver) = play(spawn, "handback_kept")
    assert intact and receiver["handbacks"] == 1
    # One block for all three segments: each later lending was released.
    assert sender["blocks_created"] == 1 and sender["segments"] == 3


def test_a_cuda_segment_to_a_peer_without_cuda_ipc_is_refused_before_sending(spawn):
    (error, counters), (head, segments) = play(spawn, "unreached")
    assert "no channel of" in error and "carries CUDA memory" in error
    assert counters["segments"] == 0
    assert (head, segments) == (b"after", [])  # nothing of it reached the peer


@fake_only  # the sender sees two devices, the receiver one (FAKE_CUDA_DEVICES)
def test_blocks_of_a_frame_refused_at_send_go_back_to_the_pool(spawn):
    (error, head, sender), (seen, receiver) = play(spawn, "abandoned")
    assert "declined a segment of 4096 bytes" in error
    assert head == b"ok" and seen == (b"y", True)
    # One block made: the refused frame's, reused by the next one (whose
    # record names a block the peer heard of, or it would close).
    assert sender["blocks_created"] == 1 and receiver["blocks_imported"] == 1
    assert sender["segments"] == 1 and sender["declined"] == 1


@fake_only  # the sender sees two devices, the receiver one (FAKE_CUDA_DEVICES)
def test_a_slab_of_a_refused_frame_is_not_dropped_ahead_of_its_setup(spawn):
    """shm_slab beside cuda_ipc: a frame refused at send had put its CPU
    segment into a new slab, whose setup frame then waits behind a frame
    the stopped peer does not read. The slab is free and soon idle, and
    the idle trim's drop goes ahead of queued frames: before (found by a
    helper's reading in session 93, fixed in 94), the peer read the drop
    of a slab it never heard of first and closed the connection. A slab
    is dropped only once its setup is out."""
    (error, answer, slab), (heads, reason) = play(spawn, "slab_drop")
    assert "declined a segment of 4096 bytes" in error
    assert reason == ""
    assert heads == [b"one-off", b"stalled", b"after"] and answer == b"ok"
    # One slab made, the refused frame's, while the peer was stopped. The
    # frame after the stall took it from the pool (its drop waited for the
    # setup, which the peer reads first), or, had a tick dropped it first,
    # went as a one-off (5 s after the last large segment).
    assert slab["slabs_created"] == 1, sorted(slab.items())
    assert (slab["segments"], slab["one_offs"]) in ((1, 1), (0, 2)), sorted(slab.items())


@fake_only  # the sender sees two devices, the receiver one (FAKE_CUDA_DEVICES)
def test_a_block_of_a_refused_frame_is_not_dropped_ahead_of_its_setup(spawn):
    """As the slab test above, for cuda_ipc: the refused frame's new block
    is free while its setup waits behind a frame the stopped peer does not
    read, and idle past 5 s at a tick; before (a helper's reading in
    session 94), its drop went first and the peer closed the connection
    ("dropped CUDA block 1, which it never announced")."""
    (error, answer, sender), (heads, reason) = play(spawn, "block_drop")
    assert "declined a segment of 4096 bytes" in error
    assert reason == ""
    assert heads == [b"stalled", b"after"] and answer == b"ok"
    assert sender["blocks_created"] in (1, 2) and sender["declined"] == 1


def test_segments_go_into_grants_and_the_oldest_makes_room_for_a_new_size(spawn):
    """cuda_ipc's grants with no agent above (_testing's grant source of
    plain driver memory, so also on a GPU whose torch has no landing pool):
    a large segment goes straight into landing memory the receiver granted,
    one of at most twice its size; two sizes have a grant each (two slots);
    a third size makes the receiver revoke the oldest (kind 38), the sender
    gives it back unused (kind 39), and a grant of the new size follows
    (docs/cuda.md, "Grants")."""
    (used, sender), (seen, receiver, memory, poisoned) = play(spawn, "granted")
    assert seen == [(b"m%d" % i, True) for i in range(len(ipc_worker.GRANTED))]
    assert used == [0, 1, 0, 1, 0, 1]  # each new size earns a grant the next takes
    assert (receiver["grants_revoked"], sender["grants_returned"]) == (1, 1)
    # 2 MiB after m0 and m1, 5 MiB after m2 and m3, 12 MiB after the
    # return and after m5.
    assert receiver["grants_made"] == 6 and sender["grants_used"] == 3
    assert sender["grants_capped"] == receiver["grants_capped"] == 0
    assert memory["made"] == 6
    assert poisoned in (None, 0)  # nothing used memory already freed


@fake_only  # the sender's cuIpcOpenMemHandle fails ($FAKE_CUDA_IPC_MEM_OPEN_FAILS)
def test_a_grant_the_sender_cannot_map_is_held_unused_until_taken_back(spawn):
    """A grant whose segment does not open at the sender is held unused (the
    segments go by block) rather than given back at once, which would have
    the receiver grant it again in the same segment, over and over (a
    helper's review: 24,600 grants in 2 s). The receiver grants each size
    once; a third size takes the oldest back, and the sender returns it."""
    sender, (seen, receiver) = play(spawn, "grant_unopened")
    assert seen == [(b"m%d" % i, True) for i in range(len(ipc_worker.UNOPENED))]
    assert sender["grants_used"] == 0 and sender["segments"] == len(ipc_worker.UNOPENED)
    # 2 MiB, 5 MiB, then 12 MiB in the first's slot once it was back.
    assert receiver["grants_made"] == 3, receiver
    assert (receiver["grants_revoked"], sender["grants_returned"]) == (1, 1)


def test_a_grant_left_unused_is_taken_back_and_its_size_earns_one_again(spawn):
    """A grant the peer leaves unused for $TORCH_RPC_EXT_CUDA_GRANT_IDLE_MS is
    revoked (kind 38) and given back (kind 39): its memory is the pool's
    again and out of cuda_ipc's bound, and none is made in its place until
    a segment of its size comes again. Before, it stayed out until the
    close."""
    (used, sender), (seen, out, receiver, poisoned) = play(spawn, "grant_idle")
    assert seen == [(b"m%d" % i, True) for i in range(4)]
    assert used == [0, 1, 0, 1]
    out_before, out_after, made_after = out
    assert out_before == 4 << 20 and out_after == 0  # (3 MiB rounded to 2 MiB steps)
    assert made_after == 2  # after m0 and m1; none after the return
    assert receiver["grants_idle"] == receiver["grants_revoked"] == 1
    assert sender["grants_returned"] == 1
    assert receiver["grants_made"] == 4  # ... then after m2 and m3
    assert poisoned in (None, 0)


def test_grants_out_count_against_the_cuda_ipc_memory_limit(spawn):
    """Granted landing memory is held by cuda_ipc until the peer writes into
    it, so it counts against the bound its blocks have
    (cuda_ipc_memory_limit), at most half of it: a grant past that is not
    made, and its segments land by copy. Before, grants were bounded only
    by slots and peers (two per device and connection, of any size)."""
    (used, sender), (seen, out, receiver) = play(spawn, "grant_limit")
    assert seen == [(b"m%d" % i, True) for i in range(4)]
    assert used == [0, 0, 0, 1]
    assert out == [2 << 20, 2 << 20, 2 << 20, 2 << 20]  # the first's, then its successor
    assert receiver["grants_over_limit"] == 2  # for m1 and m2
    assert receiver["grants_made"] == 2


def test_no_grant_is_taken_back_for_a_size_the_bound_has_no_room_for(spawn):
    """With both slots taken, a new size takes the oldest grant's slot only
    where the bound has room for it once that grant is back: revoking it
    for nothing would end a grant in use, its size would earn it again by
    copy, and the new size would revoke it again (a helper's review)."""
    (used, sender), (seen, receiver) = play(spawn, "grant_room")
    assert seen == [(b"m%d" % i, True) for i in range(len(ipc_worker.ROOM))]
    assert used == [0, 0, 0, 1, 1]
    assert receiver["grants_revoked"] == 0 and sender["grants_returned"] == 0
    assert receiver["grants_over_limit"] == 1


@fake_only  # the sender sees two devices, the receiver one (FAKE_CUDA_DEVICES)
@fake_only
def test_a_grant_whose_segment_cannot_be_shared_is_dropped_not_held(spawn):
    """A grant goes to the peer with its segment's legacy handle; where
    cuIpcGetMemHandle fails, the grant is dropped, its memory and its
    share of cuda_ipc_memory_limit given back, and the next segment of
    that size earns one again. Held unsent, as before, it kept both to the
    close (the idle revoke takes back only grants the peer has) and, as it
    fit the size, no other grant of it was made: made 1, live 1."""
    (used, sender), (seen, receiver, counts) = play(spawn, "grant_unshared")
    assert [ok for _, ok in seen] == [True] * 3
    assert used == [0, 0, 0] and sender["grants_used"] == 0
    assert receiver["grants_made"] == 3, receiver
    assert counts == {"made": 3, "freed": 3, "live": 0, "grant_bytes": 0}, counts


@fake_only
def test_a_copy_into_a_grant_still_queued_at_the_close_keeps_its_mapping(spawn):
    """The sender maps the receiver's segment to copy into a grant; at a
    close, it unmaps once its copies there completed. A copy queued behind
    a long stream (here the fake runs it 6 s late) outlasts the teardown's
    2 s deadline: closed at the deadline, as before, the mapping went under
    the queued copy, which then writes into memory no longer mapped (a
    fault in the sender's own context). Now it stays until the copy ran.
    (The receiver exits once the connection closed, and is reaped before the
    sender's close: a dead exporter's memory is the driver's to keep.)"""
    conn_s, conn_r = spawn.Pipe()
    ctl_s, ctl_s_child = spawn.Pipe()
    ctl_r, ctl_r_child = spawn.Pipe()
    ends = [spawn.Process(target=ipc_worker.run, args=(role, conn, ctl, "grant_late_copy"))
            for role, conn, ctl in (("sender", conn_s, ctl_s_child),
                                    ("receiver", conn_r, ctl_r_child))]
    for p in ends:
        p.start()
    try:
        reason = ctl_r.recv() if ctl_r.poll(120) else None
        ends[1].join(60)
        assert ends[1].exitcode == 0
        out = ctl_s.recv() if ctl_s.poll(120) else None
        ends[0].join(60)
        assert ends[0].exitcode == 0 and out is not None
    finally:
        for p in ends:
            if p.is_alive():
                p.kill()
                p.join(10)
    used, at_4s, closes, closed_after, poisoned = out
    assert used == 1 and reason
    assert at_4s == 0, "the mapping was closed before the copy into it ran"
    assert closes == 1 and closed_after >= 5, (closes, closed_after)
    assert poisoned in (None, 0)


def test_a_grant_written_for_a_frame_refused_at_send_goes_back(spawn):
    """The frame's first segment went into the receiver's grant, its second
    no channel takes: the frame is refused, and the grant goes back unasked
    (kind 39) once the copy into it is done. The receiver grants again, and
    a later segment goes into that. Before, the grant was spent: that device
    got none again on the connection."""
    (error, returned, m3, sender), (seen, receiver, poisoned) = play(spawn, "grant_abandoned")
    assert "declined a segment of 4096 bytes" in error
    assert returned == 1 and sender["grants_returned"] == 1
    assert seen == [(b"m0", True), (b"m2", True), (b"m3", True)]
    assert m3 == 1  # into the grant made on the return (or after m2)
    assert receiver["grants_revoked"] == 0
    assert poisoned in (None, 0)


def test_small_segments_of_a_frame_share_a_block_and_one_launch(spawn):
    (back_ok, first, sender), (seen, imported, receiver) = play(spawn, "gathered")
    n = len(ipc_worker.GATHERED)
    span = sum((k + 255) // 256 * 256 for k in ipc_worker.GATHERED[:-1])
    # Both frames whole; the small segments 256-aligned, side by side in one
    # block.
    assert seen == [(b"g0", True, True, span), (b"g1", True, True, span)]
    # Frame one: two blocks (the packed one and the large segment's), one
    # launch for all n + 1 segments.
    assert (first["blocks_created"], first["launches"], first["packed"]) == (2, 1, n)
    assert imported == 2
    # A region sharing its block is sent back by copy, not handed back.
    assert back_ok == (b"back", True)
    assert receiver["handbacks"] == 0 and receiver["segments"] == 1
    assert receiver["copied_bytes"] == ipc_worker.GATHERED[5]
    # Frame two reuses both blocks, released once their last region went.
    assert (sender["blocks_created"], sender["launches"], sender["packed"]) == (2, 2, 2 * n)
    assert sender["segments"] == 2 * (n + 1) and sender["declined"] == 0
    assert receiver["blocks_imported"] == 2


def test_a_region_let_go_unwaited_still_orders_the_next_copy_into_its_block(spawn):
    """A message that never lands (another of its segments failed) lets its
    regions go with no stream having waited on them. The block's release
    must still follow the sender's last copy into it: the sender's next
    copy, on another stream, waits only on `released`. Before, nothing was
    recorded, so the late first copy landed over the second message."""
    (head, sender), (at_once, later, receiver) = play(spawn, "unwaited")
    assert head == b"done"
    assert sender["blocks_created"] == 1  # the second message reused the block
    assert at_once and later


def test_a_ring_segment_refused_at_send_holds_no_later_copy_behind_its_stream(spawn):
    """cuda_ring: a frame refused at send() after its large segment's
    snapshot was queued behind the caller's stream (held by a gate). Its
    block goes back once the snapshot has run; before, the device's copy
    stream, which every later chunk of every connection goes through, was
    made to wait for that snapshot: the next frame, from another stream,
    did not arrive until the gate opened."""
    (error, head, in_time, sender), (seen, receiver) = play(spawn, "ring_dropped")
    assert "CUDA device 7 does not exist" in error, error
    assert seen == (b"y", 1, True) and head == b"ok"
    # The ring took the refused frame's segment (its snapshot queued), then
    # the next frame's.
    assert sender["segments_sent"] == 2 and receiver["segments_received"] == 1
    assert in_time


@fake_only
def test_a_closed_connections_cuda_rings_are_unmapped_and_unpinned_at_once(spawn):
    """cuda_ring: the peer exits with both rings set up (its, which we map
    and pin to copy out of, and ours), while our end still holds the
    connection. Both go when it closes; before, they stayed mapped and
    pinned (the peer's up to 256 MiB) for as long as anything held it."""
    (ok_s, sender), (ok_r, baseline, during, after, reason, receiver) = play(
        spawn, "ring_closed", worker=closed_worker)
    assert ok_s and ok_r
    assert sender["segments_sent"] == 1 and receiver["segments_sent"] == 1, (sender, receiver)
    assert during[0] >= baseline[0] + 2 and during[1] > baseline[1], (baseline, during)
    assert reason.startswith("peer closed the connection"), reason
    assert after == baseline, (baseline, during, after)


@fake_only
def test_a_closed_connections_cuda_ipc_blocks_are_let_go_at_once(spawn):
    """cuda_ipc: the peer exits holding a block of ours, ours having
    imported one of its, while our end still holds the connection. Both go
    when it closes (ours after the channel's 2 s deadline); before, they
    stayed (its device memory mapped here, ours allocated and counted
    against the device's bound) for as long as anything held it."""
    (ok_s, sender), (ok_r, baseline, during, after, reason, receiver) = play(
        spawn, "ipc_closed", worker=closed_worker)
    assert ok_s and ok_r
    assert sender["segments"] == 1 and receiver["segments"] == 1, (sender, receiver)
    counts = dict(zip(closed_worker.IPC_KEYS, zip(baseline, during, after)))
    # Ours lent and its imported: a mapping each; its two events opened.
    for key in ("vmm_mappings", "opened_ipc_events"):
        assert counts[key][1] >= counts[key][0] + 2, counts
    assert reason.startswith("peer closed the connection"), reason
    assert after == baseline, counts


@fake_only
def test_a_grant_held_at_the_close_waits_for_the_live_peers_write_into_it(spawn):
    """The receiver holds a grant at its close whose write by the sender,
    alive, is still queued (its frame refused at send, the grant's return
    never sent; the fake runs the copy 6 s late). The grant's memory stays
    out of the pool past the 2 s deadline until the sender's record of
    that write is done, then 2 s more; the sender's close of its mapping
    finds the memory still there. Before, it went back at the deadline:
    handed out again, it would have taken the late write into another
    message's landing."""
    (error, unmapped_in, poisoned), (ok, reason, out, held, after, poisoned_r, receiver) = play(
        spawn, "grant_held", worker=closed_worker)
    assert "declined a segment of 4096 bytes" in error
    assert ok and reason, reason
    assert receiver["grants_made"] >= 1 and out >= 3 << 20, (out, receiver)
    assert held == out, (out, held)
    assert after == 0
    assert unmapped_in > closed_worker.SLOW_COPY_MS / 1000 - 1, unmapped_in
    assert poisoned == poisoned_r == 0
