# SPDX-License-Identifier: BSD-3-Clause
"""The membership log's rules (csrc/agent/membership.{h,cpp}; docs/elastic.md):
every member applies the same records in the same order to the same result,
and no record, however malformed, changes more than it should."""

import threading

import pytest
import torch.distributed as dist

from torch_rpc_ext import _testing as t


def apply_all(records):
    r = t.Roster()
    return r, [r.apply(rec) for rec in records]


def test_join_leave_dead_and_reuse():
    r, evs = apply_all(
        [
            t.join_record(0, "w0", 0xA, 1000),
            t.join_record(1, "w1", 0xB, 1000),
            t.leave_record(0xA),
            t.dead_record(0xB, 0xA, "its lease was not renewed"),
            t.join_record(1, "w1", 0xC, 1000),  # a new holder of name and rank
        ]
    )
    assert [e[0] for e in evs] == ["join", "join", "leave", "dead", "join"]
    assert [e[1] for e in evs] == [1, 2, 3, 4, 5]
    assert evs[3][4] == "its lease was not renewed"
    assert r.members() == [(1, "w1")] and r.epoch == 5


def test_conflicts_and_duplicates_are_ignored_with_a_reason():
    r, evs = apply_all(
        [
            t.join_record(0, "w0", 0xA, 1000),
            t.join_record(0, "other", 0xB, 1000),  # rank held
            t.join_record(2, "w0", 0xC, 1000),  # name held
            t.join_record(3, "w3", 0xA, 1000),  # incarnation reused
            t.dead_record(0xA, 0xD, "x"),
            t.dead_record(0xA, 0xE, "y"),  # a second survivor's report
            t.leave_record(0xA),  # and its own late leave
        ]
    )
    kinds = [e[0] for e in evs]
    assert kinds == ["join", "ignored", "ignored", "ignored", "dead", "ignored", "ignored"]
    assert "rank 0 is held by w0" in evs[1][4]
    assert "name w0 is held by rank 0" in evs[2][4]
    assert r.members() == []


def test_a_join_whose_device_maps_conflict_is_ignored_by_every_member():
    """Device maps are judged by the rules, so two joiners that checked
    before seeing each other are still sorted out alike everywhere."""
    r, evs = apply_all(
        [
            t.join_record(0, "w0", 0xA, 1000, "devices 0"),
            t.join_record(2, "w2", 0xB, 1000, "devices 0\ndevicemap w0 0:1"),
            t.join_record(1, "w1", 0xC, 1000, "devices 0\ndevicemap w0 0:0"),
            t.join_record(3, "w3", 0xD, 1000, "devicemap w4 0:2"),  # w4 not here yet
            t.join_record(4, "w4", 0xE, 1000, "devices 0,1"),  # w3's map lands off it
        ]
    )
    assert [e[0] for e in evs] == ["join", "ignored", "join", "join", "ignored"]
    assert "w2 maps its cuda:0 to cuda:1 of w0" in evs[1][4]
    assert "w3 maps its cuda:0 to cuda:2 of w4" in evs[4][4]
    assert r.members() == [(0, "w0"), (1, "w1"), (3, "w3")]


def test_a_snapshot_restores_the_same_roster():
    r, _ = apply_all(
        [
            t.join_record(0, "w0", 0xA, 1000, "tcp x 1.2.3.4:5\ndevices 0"),
            t.join_record(1, "w1", 0xB, 2000),
            t.leave_record(0xA),
            t.join_record(0, "w0", 0xC, 1000),
        ]
    )
    copy = t.Roster()
    assert copy.restore(r.epoch, r.snapshot())
    assert copy.epoch == 4 and copy.members() == r.members()
    assert copy.snapshot() == r.snapshot()
    # And goes on as the original does.
    assert copy.apply(t.leave_record(0xB))[:2] == r.apply(t.leave_record(0xB))[:2]
    assert copy.members() == r.members() == [(0, "w0")]
    for garbage in (b"x", b"5\nabc", b"999\n" + r.snapshot(), t.leave_record(0xA)):
        fresh = t.Roster()
        assert not fresh.restore(7, garbage)
        assert fresh.epoch == 0 and fresh.members() == []


@pytest.mark.parametrize(
    "record",
    [
        b"",
        b"join",
        b"join 00000000000000zz 1 w 1000\n",
        b"join 0000000000000001 -1 w 1000\n",
        b"join 0000000000000001 40000 w 1000\n",
        b"join 0000000000000001 1 bad/name 1000\n",
        b"join 0000000000000001 1 w 0\n",
        b"join 0000000000000001 1 w 1000 extra\n",
        b"join 0000000000000001 1x w 1000\n",
        b"join 0000000000000001 1 w 1000ms\n",
        b"join 0000000000000001 1 w 99999999999999999999\n",
        b"join 0000000000000001 1 w\n",
        b"join 0000000000000000 1 w 1000\n",
        b"leave",
        b"resign 0000000000000001",
        b"\xff" * 100,
        b"join 0000000000000001 1 w 1000\n" + b"x" * 70000,
    ],
)
def test_malformed_records_change_nothing(record):
    r = t.Roster()
    r.apply(t.join_record(0, "w0", 0xA, 1000))
    kind, epoch, *_ = r.apply(record)
    assert kind == "ignored" and epoch == 2
    assert r.members() == [(0, "w0")]


@pytest.mark.parametrize("store_kind", ["hash", "file"])
def test_concurrent_appenders_get_distinct_epochs_without_holes(tmp_path, store_kind):
    store = dist.HashStore() if store_kind == "hash" else dist.FileStore(str(tmp_path / "s"), -1)
    epochs = []
    lock = threading.Lock()

    def appender(k):
        for i in range(10):
            e = t.log_append(store, t.join_record(100 * k + i, f"w{k}_{i}", 1 + 100 * k + i, 1000), 0)
            with lock:
                epochs.append(e)

    threads = [threading.Thread(target=appender, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(epochs) == list(range(1, 41))
    # Replaying the log gives every appended member.
    r = t.Roster()
    for e in range(1, 41):
        assert r.apply(store.get(f"log/{e}"))[0] == "join"
    assert len(r.members()) == 40


class _KeyDeletedAfterCheck(dist.Store):
    """A store in which a member's keys vanish between check() and get(),
    as when it leaves while a peer reads its acknowledgement: check() still
    says yes, and get() would block for the store's whole timeout (raised
    here instead of waited for)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def check(self, keys):
        return True

    def get(self, key):
        raise RuntimeError(f"get({key!r}) of a deleted key waits out the store's timeout")

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)


def test_reading_a_departed_members_acknowledgement_never_waits():
    """The ack of a member that left reads as 0 at once (found by
    test_dynamic_rpc_existing_rank_can_communicate_with_new_rank, which
    waited 60 s in shutdown for a key its peer had just deleted)."""
    inner = dist.HashStore()
    assert t.log_acked(_KeyDeletedAfterCheck(inner), 0xA) == 0
    inner.set("ack/000000000000000a", "7")
    assert t.log_acked(_KeyDeletedAfterCheck(inner), 0xA) == 7


def test_snapshot_writers_in_any_order_leave_the_pointers_two():
    """Snapshots of the roster, written by members in the orders churn
    gives (docs/elastic.md, "Snapshots"): the pointer names the newest and
    the one it replaced, and the store keeps just those. A member that
    reaches a boundary late deletes its own snapshot once the pointer has
    passed it, but never the one the pointer keeps as the previous (the
    same epoch written earlier by another member); the member that moves
    the pointer deletes the snapshot before the kept one. Before, every
    snapshot stayed."""
    store = dist.HashStore()
    key = b"k" * 32

    def write(epoch):
        t.log_write_snapshot(store, epoch, f"roster at {epoch}\n", key)

    def kept():
        return [e for e in range(1, 200) if store.check([f"snap/{e}"])]

    write(64)
    assert store.get("snap/latest") == b"64 0" and kept() == [64]
    write(66)  # a member past the boundary by two records
    assert store.get("snap/latest") == b"66 64" and kept() == [64, 66]
    write(64)  # a slow member, the same text: the kept one is not touched
    assert kept() == [64, 66]
    write(65)  # a member passed already: its own goes
    assert store.get("snap/latest") == b"66 64" and kept() == [64, 66]
    write(130)
    assert store.get("snap/latest") == b"130 66" and kept() == [66, 130]
    # A pointer that is not a number (a store writer's) is replaced, and
    # names nothing to delete.
    store.set("snap/latest", "garbage 66")
    write(131)
    assert store.get("snap/latest") == b"131 0" and kept() == [66, 130, 131]
