# SPDX-License-Identifier: BSD-3-Clause
"""The agent's parts driven alone (csrc/agent/group.h, rref_guard.h;
csrc/bindings/bind_testing_agent.cpp): no processes, no transports.

A Group runs its real rendezvous, membership log, watcher thread and lease
checks against an in-memory HashStore, and tells a recording GroupListener
what it would tell the agent (a member departed, we were fenced). The
RRefGuard attributes forks from fork requests, deletions and pickled bytes.
"""

import os
import pickle
import threading
import time

import pytest
import torch.distributed as dist

from torch_rpc_ext import _testing as t

A = t.agent
# Where a dynamic group's membership log lives: one log per secret the
# group made (SecretExchange::logPrefix), the first under "e0/".
E0 = "e0/"
KEY = b"k" * 32  # a passphrase given out of band: it admits joiners (session 110)


def wait_for(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def join_all(groups, offers):
    """Join each group on a thread of its own (a static join blocks until
    every worker has published)."""
    errors = []

    def run(g, o):
        try:
            g.join(o)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(g, o)) for g, o in zip(groups, offers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors


@pytest.fixture(autouse=True)
def _every_group_stopped(monkeypatch):
    """Every Group a test made is stopped when it ends, passed or failed.
    A failed assertion used to leave its groups' watchers renewing leases
    and reading a store whose Python wrapper was gone (c10d's trampoline
    then answers "Not implemented") for the rest of the session, and a
    later test forking with those threads alive made ThreadSanitizer's
    children die ("dup thread with used id"). (Stopping a stopped group
    does nothing.)"""
    made = []
    real = A.Group

    def make(*args, **kwargs):
        g = real(*args, **kwargs)
        made.append(g)
        return g

    monkeypatch.setattr(A, "Group", make)
    yield
    for g in made:
        g.stop()


# ---- A static group ----------------------------------------------------------


def test_a_static_group_learns_every_worker_and_their_routes():
    store = dist.HashStore()
    gs = [A.Group(store, f"w{r}", r, 3) for r in range(3)]
    join_all(gs, [f"addr{r}" for r in range(3)])
    for g in gs:
        assert g.members() == [(r, f"w{r}", 0, f"addr{r}") for r in range(3)]
        assert g.incarnation == 0 and g.epoch == 0
    assert gs[0].worker("w2") == 2
    with pytest.raises(RuntimeError, match=r"could not find destination name w9 \(known workers: w0, w1, w2\)"):
        gs[0].worker("w9")


def test_a_static_groups_barrier_sums_every_workers_value():
    store = dist.HashStore()
    gs = [A.Group(store, f"w{r}", r, 2) for r in range(2)]
    join_all(gs, ["a", "b"])
    sums = [None, None]

    def run(i, v):
        sums[i] = gs[i].barrier(v)

    threads = [threading.Thread(target=run, args=(i, v)) for i, v in enumerate((3, 4))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sums == [7, 7]


def test_a_duplicate_name_fails_the_static_rendezvous():
    store = dist.HashStore()
    gs = [A.Group(store, "same", r, 2) for r in range(2)]
    with pytest.raises(AssertionError, match="is not unique"):
        join_all(gs, ["a", "b"])


# ---- A dynamic group: the log, the watcher, the leases ------------------------


def test_dynamic_members_see_each_other_join_and_leave():
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0)
    a.join("addr-a")
    b = A.Group(store, "b", 1, 0)
    b.join("addr-b")  # returns once a has acknowledged it
    assert a.incarnation != 0 and b.incarnation not in (0, a.incarnation)
    assert [m[:2] for m in a.members()] == [(0, "a"), (1, "b")]
    assert a.members()[1][3] == "addr-b"  # routed by the listener
    assert a.events(5) == [("join", 2, "b", 1, "")]
    b.leave()
    wait_for(lambda: a.epoch == 3, what="the leave applied")
    assert a.events(5) == [("leave", 3, "b", 1, "")]
    # The listener heard it, and calls to b fail with the reason.
    assert a.departed() == [("b", False, "b left the group at epoch 3")]
    with pytest.raises(RuntimeError, match="b left the group at epoch 3"):
        a.worker("b")
    a.stop()
    b.stop()
    assert a.events(0.1) is None  # stopped


def test_a_member_whose_lease_lapses_and_does_not_answer_is_declared_dead():
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=0.3)
    secret = a.join("addr-a")
    # A member that never renews its lease (its process died right after
    # its join record landed).
    ghost = 0xDEAD
    t.log_append(store, t.join_record(1, "ghost", ghost, 300), 0, secret, E0)
    wait_for(lambda: any(d[0] == "ghost" for d in a.departed()), what="ghost declared dead")
    name, dead, why = a.departed()[0]
    assert dead and "ghost was declared dead at epoch 3" in why
    assert "its lease was not renewed for 0.3 s (seen by a)" in why
    assert "ghost" in a.probes()  # asked the transport before declaring it
    # The listener hears of the death before the event is queued: collect
    # until both events are in (a read in between would see the join alone).
    kinds = []
    wait_for(
        lambda: kinds.extend(e[0] for e in a.events(0.1) or []) or len(kinds) >= 2,
        what="the join and dead events",
    )
    assert kinds == ["join", "dead"]
    assert a.admission_error(1, ghost).startswith("worker id 1 is not a member of the group")
    a.stop()


def test_a_member_that_answers_probes_is_kept_for_a_few_leases_only():
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=0.2, answers_probes=True)
    secret = a.join("addr-a")
    t.log_append(store, t.join_record(1, "stalled", 0xBEEF, 200), 0, secret, E0)
    start = time.monotonic()
    wait_for(lambda: a.departed(), what="stalled declared dead")
    # Reachable, but renewing nothing: dead after kMaxLeaseProbing (3)
    # leases of probing, not at the first lapse.
    assert time.monotonic() - start >= 3 * 0.2
    assert len(a.probes()) >= 2
    a.stop()


def test_a_member_declared_dead_is_fenced():
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0)
    secret = a.join("addr-a")
    t.log_append(store, t.dead_record(a.incarnation, 0x1, "a partition"), 0, secret, E0)
    wait_for(lambda: a.fenced, what="fenced")
    assert "this worker (a) was declared dead by the group at epoch 2: a partition" in a.fenced
    # The flag is set first (sends are refused from then on), then the
    # listener is told (it closes the connections): wait for the second.
    wait_for(lambda: a.fenced_reason_heard(), what="the listener told")
    assert a.fenced_reason_heard() == a.fenced
    a.stop()


def test_records_without_the_groups_proof_change_nothing():
    """Anyone who can write the store can append to the membership log.
    Records carry the group's proof (an HMAC under its secret, bound to
    their epoch), and members pass over those that do not: before, a
    forged `dead` record fenced a member, a forged `join` held a rank, and
    a member's own join record copied past its leave brought it back."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0, secret=KEY)
    secret = a.join("addr-a")
    b = A.Group(store, "b", 1, 0, lease_s=2.0, secret=KEY)
    b.join("addr-b")
    b_join = store.get(E0 + "log/2")  # b's record, its proof and all
    body, proven = t.log_read(store, 2, secret, E0)
    assert proven and body.startswith(b"join ") and t.log_read(store, 2, prefix=E0) == (body, False)
    b.leave()
    wait_for(lambda: a.epoch == 3, what="b's leave applied")
    assert a.events(5) == [("join", 2, "b", 1, ""), ("leave", 3, "b", 1, "")]
    forged = [
        t.dead_record(a.incarnation, 0x1, "forged"),  # bare
        t.join_record(2, "ghost", 0xD00D, 2000),
        t.dead_record(a.incarnation, 0x1, "forged"),  # under another secret
    ]
    t.log_append(store, forged[0], 3, prefix=E0)
    t.log_append(store, forged[1], 3, prefix=E0)
    t.log_append(store, forged[2], 3, b"x" * 32, E0)
    # b's join, proof and all, where its leave is past: the proof names
    # epoch 2, not this one.
    assert store.compare_set(E0 + "log/7", b"", b_join) == b_join
    t.log_append(store, t.join_record(3, "ghost2", 0xF00D, 2000), 7, secret[:-1], E0)
    wait_for(lambda: a.epoch == 8, what="the forged records passed over")
    assert not a.fenced
    assert [m[:2] for m in a.members()] == [(0, "a")]
    assert a.events(0.3) == []  # nothing changed
    assert a.metrics()["rpc_ext.membership.unproven_records"] == "5"
    assert t.log_read(store, 4, secret, E0) == (forged[0], False)
    # The group goes on: a joiner's record lands after them, and everyone
    # agrees on who is in.
    c = A.Group(store, "c", 2, 0, lease_s=2.0, secret=KEY)
    assert c.join("addr-c") == secret
    wait_for(lambda: a.epoch == 9, what="c's join applied")
    assert [m[:2] for m in a.members()] == [(0, "a"), (2, "c")]
    assert [m[:2] for m in c.members()] == [(0, "a"), (2, "c")]
    assert a.events(5) == [("join", 9, "c", 2, "")]
    for g in (a, b, c):
        g.stop()


def test_a_lease_bumped_by_a_store_writer_renews_nothing():
    """A member's lease is its counter in the store, with its proof. A
    writer bumping a dead member's counter (the store's add, as members
    renewed before) kept it alive for good: no member declared it dead, and
    its rank stayed held. Now only a proven, higher count renews it."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=0.3)
    secret = a.join("addr-a")
    ghost = 0xDEAD
    t.log_append(store, t.join_record(1, "ghost", ghost, 300), 0, secret, E0)
    stop = threading.Event()

    def bump():
        while not stop.is_set():
            store.add(f"{E0}beat/{ghost:016x}", 1)
            time.sleep(0.03)

    writer = threading.Thread(target=bump, daemon=True)
    writer.start()
    try:
        wait_for(lambda: any(d[0] == "ghost" for d in a.departed()), what="ghost declared dead")
    finally:
        stop.set()
        writer.join()
    assert "its lease was not renewed for 0.3 s" in a.departed()[0][2]
    a.stop()


def test_an_acknowledgement_written_by_a_store_writer_proves_nothing():
    """A joiner returns once every member has acknowledged its join (a
    member may call it as soon as its init_rpc returns). A writer's ack
    for a member that had not applied the join (here stopped) let the
    joiner return before; now the joiner waits for the member's own."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=5.0, secret=KEY)
    a.join("addr-a")
    c = A.Group(store, "c", 2, 0, lease_s=5.0, secret=KEY)
    c.join("addr-c")  # (it answers b's proof while a is stopped)
    a.freeze()
    b = A.Group(store, "b", 1, 0, lease_s=5.0, secret=KEY)
    joined = threading.Event()
    joiner = threading.Thread(target=lambda: (b.join("addr-b"), joined.set()), daemon=True)
    joiner.start()
    wait_for(lambda: t.log_read(store, 3, prefix=E0) is not None, what="b's join record")
    store.set(f"{E0}ack/{a.incarnation:016x}", "999")
    time.sleep(1.0)
    assert not joined.is_set()
    a.thaw()
    assert joined.wait(10)
    joiner.join(10)
    assert [m[:2] for m in a.members()] == [(0, "a"), (1, "b"), (2, "c")]
    b.stop()
    c.stop()
    a.stop()


def test_a_joiner_starts_from_no_snapshot_without_the_groups_proof(monkeypatch):
    """A joiner starts from the newest snapshot of the roster; one written
    by someone without the secret (here listing a ghost, at an epoch far
    ahead) is not used: the joiner reads the log from its first record and
    agrees with the members. Before, it took the forged roster."""
    monkeypatch.setenv("TORCH_RPC_EXT_LOG_SNAPSHOT_EVERY", "2")
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    secret = a.join("addr-a")
    b = A.Group(store, "b", 1, 0, lease_s=2.0)
    b.join("addr-b")
    wait_for(lambda: store.check([E0 + "snap/2"]), what="a's snapshot at epoch 2")
    forged = t.Roster()
    forged.apply(t.join_record(0, "a", a.incarnation, 2000))
    forged.apply(t.join_record(5, "ghost", 0xD00D, 2000))
    store.set(E0 + "snap/100", forged.snapshot())
    store.set(E0 + "snap/latest", "100")
    c = A.Group(store, "c", 2, 0, lease_s=2.0)
    assert c.join("addr-c") == secret
    assert [m[:2] for m in c.members()] == [(0, "a"), (1, "b"), (2, "c")]
    wait_for(lambda: a.epoch == 3, what="c's join applied")
    assert [m[:2] for m in a.members()] == [(0, "a"), (1, "b"), (2, "c")]
    for g in (a, b, c):
        g.stop()


def test_a_churning_groups_store_keeps_two_snapshots_and_joiners_use_the_newest(monkeypatch):
    """A snapshot of the roster every 2 epochs here (64 by default) through
    eight joins and leaves: the store keeps the newest snapshot and the one
    before it (for a joiner that read the pointer just before it moved),
    not all of them (before: every one stayed, each a copy of every
    member's join record). A joiner starts from the newest; one whose
    snapshot was deleted under it reads the log from its first record and
    agrees with the members all the same."""
    monkeypatch.setenv("TORCH_RPC_EXT_LOG_SNAPSHOT_EVERY", "2")
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    secret = a.join("addr-a")
    for i in range(8):
        b = A.Group(store, f"b{i}", 1, 0, lease_s=2.0)
        assert b.join(f"addr-b{i}") == secret
        b.leave()
        b.stop()
    wait_for(lambda: a.epoch == 17, what="a to apply every join and leave")

    def snapshots():
        return [e for e in range(1, 20) if store.check([f"{E0}snap/{e}"])]

    def pointer():
        return [int(f) for f in store.get(E0 + "snap/latest").split()]

    # (At 16, or 17 where a applied two records in one turn. The pointer
    # moves before the snapshot it passed is deleted: wait for both.)
    wait_for(lambda: pointer()[0] >= 16 and len(snapshots()) == 2,
             what="the last snapshot")
    newest, kept = pointer()
    assert snapshots() == [kept, newest] and 12 <= kept < newest
    c = A.Group(store, "c", 2, 0, lease_s=2.0)
    assert c.join("addr-c") == secret
    assert c.metrics()["rpc_ext.membership.start_epoch"] == str(newest)
    wait_for(lambda: pointer()[0] == 18 and snapshots() == [newest, 18],
             what="the snapshot at c's join")
    # The newest snapshot gone under a joiner: the whole log, same roster.
    store.delete_key(E0 + "snap/18")
    d = A.Group(store, "d", 3, 0, lease_s=2.0)
    assert d.join("addr-d") == secret
    assert d.metrics()["rpc_ext.membership.start_epoch"] == "0"
    wait_for(lambda: a.epoch == 19, what="c's and d's joins applied")
    expected = [(0, "a"), (2, "c"), (3, "d")]
    assert [m[:2] for m in d.members()] == expected
    assert [m[:2] for m in a.members()] == expected
    for g in (a, c, d):
        g.stop()


class _PassThroughStore(dist.Store):
    """A store that passes every call to `inner`: the wrappers below
    override what they stage."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, n):
        return self.inner.add(key, n)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def deleteKey(self, key):  # the name c10d's trampoline calls from C++
        return self.delete_key(key)


class _StallsBeforeItsSnapshot(_PassThroughStore):
    """A joiner's store that, once the joiner holds the secret, runs
    `meanwhile` between its read of the snapshot pointer and its read of
    the snapshot it names (a joiner stalled there: swapped out, a slow
    store)."""

    def __init__(self, inner, meanwhile):
        super().__init__(inner)
        self.meanwhile = meanwhile
        self.armed = False
        self.named = []  # every snapshot read through it, in order
        self.stalled = None  # the index in `named` of the read that stalled

    def compare_set(self, key, expected, desired):
        if "/sealed/" in key:  # its read of the answer
            got = self.inner.compare_set(key, expected, desired)
            self.armed = got != expected  # there: catching up comes next
            return got
        snap = key.startswith(E0 + "snap/") and key != E0 + "snap/latest"
        if snap and expected == desired:  # a snapshot read
            self.named.append(int(key.rsplit("/", 1)[1]))
            if self.armed:
                self.armed = False
                self.stalled = len(self.named) - 1
                self.meanwhile()
        return self.inner.compare_set(key, expected, desired)


def test_a_joiner_whose_snapshot_went_while_it_stalled_starts_from_the_newest(monkeypatch):
    """A joiner read the snapshot pointer, then stalled while the group
    went through two more snapshots (the second move deletes the one it
    had read): it reads the pointer again and starts from the newest
    snapshot. Before, it read the whole log from its first record (the
    same roster, at the cost of every record since the group began)."""
    monkeypatch.setenv("TORCH_RPC_EXT_LOG_SNAPSHOT_EVERY", "2")
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    secret = a.join("addr-a")

    def churn(cycles):
        for i in range(cycles):
            b = A.Group(store, "b", 1, 0, lease_s=2.0)
            assert b.join(f"addr-b{i}") == secret
            b.leave()
            b.stop()

    def pointer():
        return [int(f) for f in store.get(E0 + "snap/latest").split()]

    churn(2)
    wait_for(lambda: a.epoch == 5 and pointer()[0] == 4, what="a snapshot at 4")

    def two_moves():
        churn(2)
        wait_for(lambda: a.epoch == 9 and pointer()[0] == 8 and
                 not store.check([E0 + "snap/4"]), what="two more snapshots")

    stalling = _StallsBeforeItsSnapshot(store, two_moves)  # held: c calls it
    c = A.Group(stalling, "c", 2, 0, lease_s=2.0)
    assert c.join("addr-c") == secret
    # The read that stalled named 4, gone once read; the next read, 8. (Not
    # the last two reads: a member writing a snapshot reads the one the
    # pointer names to check it, so c may have read 10 by now.)
    at = stalling.stalled
    assert at is not None and stalling.named[at:at + 2] == [4, 8], stalling.named
    assert c.metrics()["rpc_ext.membership.start_epoch"] == "8"
    wait_for(lambda: a.epoch == 10, what="c's join applied")
    assert [m[:2] for m in c.members()] == [(0, "a"), (2, "c")]
    assert [m[:2] for m in a.members()] == [(0, "a"), (2, "c")]
    for g in (a, c):
        g.stop()


def test_a_joiner_keeps_a_lapsed_member_whose_listener_answers_for_a_few_leases():
    """A member stopped past its lease (a debugger, a stalled host) still
    has its listener answered by its kernel. A joiner that finds every
    listed member lapsed knocks on their listeners, and keeps one that
    answers for kMaxLeaseProbing (3) more leases, as the members keep each
    other: continued within them, the member seals the secret it holds.
    Before, judged by the lease alone, the joiner ended the epoch one lease
    in and started a second group beside the stopped member's."""
    store = dist.HashStore()
    # 2 s leases: the joiner sees a lapsed 2 s after it first saw its beat
    # (0.5 s in, at the earliest), and ends its epoch 6 s after that; the
    # check at 4.5 s has 4 s to spare on a loaded host (2 s with 1 s leases).
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    first = a.join("addr-a")
    a.freeze()
    b = A.Group(store, "b", 1, 0, lease_s=2.0, answers_probes=True)
    got = []
    joiner = threading.Thread(target=lambda: got.append(b.join("addr-b")), daemon=True)
    joiner.start()
    time.sleep(4.5)  # a lapsed for more than a lease, fewer than four
    assert store.add("torch_rpc_ext/dyn_secret/epoch", 0) == 0
    assert not got
    a.thaw()
    joiner.join(30)
    assert got == [first]
    assert [m[:2] for m in b.members()] == [(0, "a"), (1, "b")]
    b.stop()
    a.stop()


def test_a_member_left_behind_when_the_group_starts_over_is_fenced():
    """A member whose process stops past its lease, while a joiner finds
    nobody alive to seal the secret, is left behind: the group starts over
    with a new secret, whose records prove nothing to the old member (nor
    its to them), so no member there declares it dead. Continued, it finds
    its epoch ended and fences itself, naming that, rather than go on as a
    group of one."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=0.3)
    first = a.join("addr-a")
    a.freeze()
    b = A.Group(store, "b", 1, 0, lease_s=0.3)
    renewed = b.join("addr-b")
    assert renewed != first
    assert [m[:2] for m in b.members()] == [(1, "b")]  # a's join proves nothing
    a.thaw()
    wait_for(lambda: a.fenced, what="a fenced")
    assert "the group started over with a new secret" in a.fenced
    wait_for(lambda: a.fenced_reason_heard(), what="the listener told")
    b.stop()
    a.stop()


def test_the_holders_of_a_name_share_its_statistics():
    """A member keeps a Peer for every worker that ever joined (raw
    pointers to them outlive calls), but its statistics are its name's:
    metrics report them per name, summed over its holders, and each holder
    kept about 8 KiB of call-cost histograms of its own before, so a long
    job with churn grew by that per departure on every member that stayed."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    a.join("addr-a")
    for k in range(3):
        b = A.Group(store, "b", 1, 0, lease_s=2.0)
        b.join(f"addr-b{k}")
        b.leave()
        b.stop()
    wait_for(lambda: a.epoch == 7, what="three joins and leaves applied")
    assert a.peer_records() == (4, 2)  # a, and b three times: two names
    a.stop()


def test_a_join_that_failed_records_no_leave():
    """init_rpc of a worker whose name is held by a live member fails, and
    the agent stops its group. Nothing of it was applied, so nothing is
    taken back: before, the stop appended a `leave` that every member read
    and passed over, an epoch spent per failed init_rpc."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    a.join("addr-a")
    epoch = a.epoch
    b = A.Group(store, "a", 1, 0, lease_s=0.3)  # a's name, another rank
    with pytest.raises(RuntimeError, match="which is alive"):
        b.join("addr-b")
    b.stop()
    time.sleep(0.5)  # a's watcher reads the log a few times
    assert t.log_read(store, epoch + 1, prefix=E0) is None
    assert a.epoch == epoch and not a.fenced
    # Nor is its lease key left in the store (it was, one per failed join).
    assert f"{E0}beat/{b.incarnation:016x}" not in store.list_keys()
    a.stop()


class _FailsReadingBackItsJoin(_PassThroughStore):
    """A store that stops answering reads of the log right after the
    joiner's record went in (the store's host under load, a network
    partition): the join is in the log, but the joiner cannot read it back."""

    def __init__(self, inner, rank):
        super().__init__(inner)
        self.mark = f" {rank} joiner ".encode()
        self.broken = False

    def compare_set(self, key, expected, desired):
        if self.broken and expected == desired:  # a read (MembershipLog::peek)
            raise RuntimeError(f"the store stopped answering reading {key}")
        got = self.inner.compare_set(key, expected, desired)
        if self.mark in desired and got == desired:
            self.broken = True
        return got


def test_a_join_the_joiner_could_not_read_back_is_taken_back():
    """The joiner's record went into the log, then the store failed it: its
    init_rpc fails, and it records its leave at once rather than leave the
    members to wait out its lease (they had applied its join). Before, the
    members declared it dead once its lease ran out, and its lease key
    stayed in the store."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    a.join("addr-a")
    epoch = a.epoch
    failing = _FailsReadingBackItsJoin(store, 1)  # held: the group calls it
    b = A.Group(failing, "joiner", 1, 0, lease_s=2.0)
    with pytest.raises(RuntimeError, match="stopped answering"):
        b.join("addr-b")
    body, proven = t.log_read(store, epoch + 1, prefix=E0)
    assert body.startswith(b"join ") and b" 1 joiner " in body
    record = t.log_read(store, epoch + 2, prefix=E0)
    assert record is not None and record[0] == f"leave {b.incarnation:016x}".encode(), record
    assert f"{E0}beat/{b.incarnation:016x}" not in store.list_keys()
    wait_for(lambda: a.epoch == epoch + 2, what="b's join and leave applied")
    assert a.events(5) == [("join", epoch + 1, "joiner", 1, ""), ("leave", epoch + 2, "joiner", 1, "")]
    assert [m[1] for m in a.members()] == ["a"] and not a.fenced
    b.stop()
    a.stop()


def test_an_epoch_ended_under_a_live_member_does_not_fence_it():
    """A member fences itself when its secret's epoch ended while its own
    lease had lapsed (it was left behind). An epoch ended under a lease
    that held (a joiner that saw nobody alive, or anyone who can write the
    store) is said and not obeyed: the member and its group go on. Before,
    one add() to the store's epoch counter fenced every member."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    a.join("addr-a")
    store.add("torch_rpc_ext/dyn_secret/epoch", 1)
    time.sleep(1.5)  # a lease check every 0.4 s
    assert not a.fenced
    b = A.Group(store, "b", 1, 0, lease_s=0.3)
    b.join("addr-b")  # the new epoch's: a group of its own
    assert [m[:2] for m in b.members()] == [(1, "b")]
    assert not a.fenced and [m[:2] for m in a.members()] == [(0, "a")]
    b.stop()
    a.stop()


@pytest.mark.parametrize("secret", [b"", KEY], ids=["group-made", "out-of-band"])
def test_a_log_an_earlier_version_wrote_is_refused(secret):
    """A version before session 77 wrote bare records at the store's root;
    ours pass them over (and it ours), so a joiner of this version in such
    a group would make a second group beside it, silently. It refuses,
    naming that."""
    store = dist.HashStore()
    t.log_append(store, t.join_record(0, "old", 0xA, 2000), 0)
    store.add("beat/000000000000000a", 1)
    b = A.Group(store, "b", 1, 0, lease_s=2.0, secret=secret)
    with pytest.raises(RuntimeError, match="written by another version of torch_rpc_ext"):
        b.join("addr-b")
    b.stop()


def test_a_new_holder_of_a_rank_reserves_the_next_id_range():
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0)
    a.join("x")
    b = A.Group(store, "b", 1, 0)
    b.join("y")
    b.leave()
    wait_for(lambda: a.epoch == 3, what="the leave applied")
    b2 = A.Group(store, "b", 1, 0)
    b2.join("z")
    assert a.reserved() == [(0, 1)]
    assert b.reserved() == [(1, 1)] and b2.reserved() == [(1, 2)]
    for g in (a, b, b2):
        g.stop()


# ---- The RRef guard ----------------------------------------------------------


def test_fork_requests_attribute_forks_to_their_sender_until_deleted():
    g = A.RRefGuard(0)
    fork = (2, 9)  # forked by worker 2
    assert g.holder_of(fork) == 2  # unknown: its minter
    g.serve(fork, holder=3)  # worker 3 registered it
    assert g.holder_of(fork) == 3
    assert g.holder_of((2, 10)) == 2  # another fork stays its minter's
    g.serve(fork, delete=True)
    assert g.holder_of(fork) == 2


@pytest.mark.parametrize("local", [7, 300, 70_000, 2**33 + 5])
def test_forks_are_found_in_what_pythons_pickler_writes(local):
    me = 4
    ours = ((me, local), (me, local + 1))
    other = ((me, local + 2), (me, local + 3))
    # The fork data as _InternalRPCPickler writes it: a tuple of ints, after
    # the global it reduces RRefs with.
    data = (me, *ours[0], *ours[1], me)
    payload = b"\x80\x02c_py_rref_receiver\n" + pickle.dumps(data, protocol=2)
    assert A.forks_carried(payload, me, [ours, other]) == [ours[1]]
    # Without the pickler's global, nothing is scanned for.
    assert A.forks_carried(pickle.dumps(data, protocol=2), me, [ours]) == []


# ---- a dynamic group's secret (csrc/agent/group_secret.cpp) ----------------


class RecordingRelay:
    """Forwards connections to 127.0.0.1:`port` and keeps every byte that
    crosses it, both ways: what a tap on the store's plain TCP sees."""

    def __init__(self, port):
        import socket

        self.seen = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket

        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b):
        try:
            while data := a.recv(65536):
                with self.lock:
                    self.seen += data
                b.sendall(data)
        except OSError:
            pass

    def close(self):
        self.listener.close()


def test_a_dynamic_groups_secret_never_crosses_the_store_in_the_clear():
    """Without a secret of its own, the first member makes the group's
    secret and a member seals it to each joiner's X25519 key: everything
    the store carried (recorded at its port, as a tap would) holds neither
    the secret nor anything it could be read from. (Before: the first
    member wrote it under torch_rpc_ext/secret, and it crossed in the
    clear.)"""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    relay = RecordingRelay(server.port)
    stores = [
        dist.TCPStore("127.0.0.1", relay.port, is_master=False, wait_for_workers=False)
        for _ in range(3)
    ]
    gs = [A.Group(stores[r], f"w{r}", r, 0, lease_s=2.0) for r in range(3)]
    try:
        secrets = [g.join(f"addr{r}") for r, g in enumerate(gs)]
        assert len(secrets[0]) == 32 and secrets[1] == secrets[0] == secrets[2]
        with relay.lock:
            seen = bytes(relay.seen)
        assert len(seen) > 1000  # the joins went through the tap
        assert secrets[0] not in seen
        assert b"dyn_secret/0/sealed/2" in seen  # the sealed exchange, seen
    finally:
        for g in gs:
            g.stop()
        relay.close()


def test_a_dynamic_group_that_lost_every_member_starts_over_with_a_new_secret():
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    first = a.join("addr-a")
    b = A.Group(store, "b", 1, 0, lease_s=2.0)
    assert b.join("addr-b") == first  # sealed to b by a
    b.leave()
    a.leave()
    a.stop()
    b.stop()
    # Nobody left to seal the old secret: a new group, a new secret, and
    # its joiners share it.
    c = A.Group(store, "c", 2, 0, lease_s=2.0)
    t0 = time.monotonic()
    renewed = c.join("addr-c")
    assert time.monotonic() - t0 < 10
    assert len(renewed) == 32 and renewed != first
    d = A.Group(store, "d", 3, 0, lease_s=2.0)
    assert d.join("addr-d") == renewed
    # The new group's log is its own ("e1/"): the old group's records,
    # proven under the old secret, are not read (before, session 77's
    # first proofs: every one of them passed over as unproven, by every
    # joiner of the new group, for good).
    assert c.epoch == 2 and d.epoch == 2
    assert c.metrics()["rpc_ext.membership.unproven_records"] == "0"
    assert store.check(["e1/log/1"]) and not store.check(["e1/log/3"])
    d.stop()
    c.stop()


def test_a_request_counted_but_never_written_holds_up_nobody_after_it():
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    first = a.join("addr-a")
    # A joiner that died between counting its request and writing its key.
    store.add("torch_rpc_ext/dyn_secret/0/requests", 1)
    b = A.Group(store, "b", 1, 0, lease_s=2.0)
    assert b.join("addr-b") == first
    b.stop()
    a.stop()


def test_a_joiners_request_for_the_secret_leaves_nothing_in_the_store():
    """A joiner, once joined (every member has acknowledged its join, so
    has seen the answer), deletes its request for the secret and the
    answer: a long-lived group's store keeps nothing per join of them
    (before: two keys, about 130 bytes, every join, for good). Until then
    they stay (c, frozen as a stopped process is, has not acknowledged).
    A member that counted a request and finds neither key writes nothing
    back and lets it go within 10 s, as it lets go a request whose joiner
    died between counting and writing it (before: looked for on every turn
    of its watcher, until 256 newer requests pushed it out)."""
    store = dist.HashStore()
    ex = "torch_rpc_ext/dyn_secret/0/"
    waiting = "rpc_ext.membership.secret_requests_waiting"
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    first = a.join("addr-a")
    c = A.Group(store, "c", 2, 0, lease_s=60.0)  # frozen, alive all along
    assert c.join("addr-c") == first  # request 1, answered by a
    assert not store.check([ex + "request/1"]) and not store.check([ex + "sealed/1"])
    # Its own request is not one c looks for (a few turns of its watcher).
    time.sleep(0.5)
    assert c.metrics()[waiting] == "0"
    c.freeze()
    b = A.Group(store, "b", 1, 0, lease_s=2.0)
    got = []
    joiner = threading.Thread(target=lambda: got.append(b.join("addr-b")), daemon=True)
    joiner.start()  # request 2, answered by a
    # b holds the secret once its join record is in the log (a's is the
    # first, c's the second); its join then waits for c to acknowledge it.
    wait_for(lambda: store.check([E0 + "log/3"]), what="b's join record")
    assert store.check([ex + "request/2"]) and store.check([ex + "sealed/2"])
    store.add(ex + "requests", 1)  # request 3: its joiner died before writing it
    c.thaw()
    joiner.join(30)
    assert got == [first]
    assert store.add(ex + "requests", 0) == 3
    assert not store.check([ex + "request/2"]) and not store.check([ex + "sealed/2"])
    wait_for(lambda: c.metrics()[waiting] != "0", timeout=5, what="c to count request 3")
    wait_for(lambda: c.metrics()[waiting] == "0" and a.metrics()[waiting] == "0",
             timeout=20, what="a and c to let request 3 go")
    for n in (2, 3):
        assert not store.check([f"{ex}sealed/{n}"]), n
    # And c, the last to serve, still seals for a new joiner, who cleans up.
    a.stop()
    d = A.Group(store, "d", 3, 0, lease_s=2.0)
    assert d.join("addr-d") == first
    assert not store.check([ex + "request/4"]) and not store.check([ex + "sealed/4"])
    for g in (d, b, c):
        g.stop()


def test_a_request_counted_just_before_a_members_own_is_still_answered():
    """A joiner that counted its request just before another joiner, and
    stalled a moment before writing it, is answered by that other joiner
    once it is a member, though the member that answered it has left
    meanwhile. Before, a member let a request counted before its own go at
    its first look (it took \"missing\" for \"not coming\"), and the
    stalled joiner waited out init_rpc's timeout with nobody to answer it."""
    store = dist.HashStore()
    ex = "torch_rpc_ext/dyn_secret/0/"
    a = A.Group(store, "a", 0, 0, lease_s=2.0)
    first = a.join("addr-a")
    assert store.add(ex + "requests", 1) == 1  # a joiner counted, then stalled
    c = A.Group(store, "c", 2, 0, lease_s=2.0)
    assert c.join("addr-c") == first  # request 2, answered by a
    time.sleep(0.5)  # c has looked for request 1 at least once
    a.leave()
    a.stop()
    # The stalled joiner writes its request (its public key): c answers.
    store.set(ex + "request/1", bytes([9]) + bytes(31))
    wait_for(lambda: store.check([ex + "sealed/1"]), timeout=10,
             what="c to answer request 1")
    c.stop()


class _SecretRaceStore(_PassThroughStore):
    """A pass-through store that stages one interleaving of the secret
    exchange's request 1 (group_secret.cpp), for the joiner (`joiner=True`)
    or a member. The joiner's write of its request stalls 5.3 s (a store
    under load), and its deletion of that request waits until the member
    has read the key; the member's answer to it lands only once the joiner
    has deleted its keys. Every wait is bounded (20 s): what did not
    happen shows in the test's assertions, not as a hang."""

    def __init__(self, inner, joiner, events):
        super().__init__(inner)
        self.joiner = joiner
        self.events = events
        self.stalled = False

    def set(self, key, value):
        if self.joiner and key.endswith("dyn_secret/0/request/1") and not self.stalled:
            self.stalled = True
            time.sleep(5.3)
        self.inner.set(key, value)

    def delete_key(self, key):
        if self.joiner and key.endswith("dyn_secret/0/request/1"):
            self.events["member read request 1"].wait(20)
        got = self.inner.delete_key(key)
        if self.joiner and key.endswith("dyn_secret/0/sealed/1"):
            self.events["joiner forgot request 1"].set()
        return got

    def compare_set(self, key, expected, desired):
        if not self.joiner and key.endswith("dyn_secret/0/sealed/1") and not expected:
            self.events["joiner forgot request 1"].wait(20)
        got = self.inner.compare_set(key, expected, desired)
        if (not self.joiner and key.endswith("dyn_secret/0/request/1")
                and expected == desired and got != expected):  # a read, and there
            self.events["member read request 1"].set()
        return got


def test_a_joiner_whose_request_was_slow_to_write_asks_again_and_no_answer_stays():
    """A joiner whose request took 5 s or more to write (counted, then
    its key set) asks again under a new number: the members may have let
    the first go (they do after 10 s). It deletes the first request; a
    member that read that request just before, and whose answer lands just
    after, deletes its answer (nobody will read it). The joiner is served
    under the second number and, joined, deletes that one too: nothing of
    either stays in the store. Before session 91 neither path was driven
    by a test."""
    store = dist.HashStore()
    ex = "torch_rpc_ext/dyn_secret/0/"
    waiting = "rpc_ext.membership.secret_requests_waiting"
    events = {"member read request 1": threading.Event(),
              "joiner forgot request 1": threading.Event()}
    member_store = _SecretRaceStore(store, False, events)  # held: a calls it
    a = A.Group(member_store, "a", 0, 0, lease_s=30.0)
    first = a.join("addr-a")
    joiner_store = _SecretRaceStore(store, True, events)
    b = A.Group(joiner_store, "b", 1, 0, lease_s=30.0)
    assert b.join("addr-b") == first
    assert events["member read request 1"].is_set()  # a read request 1 ...
    assert events["joiner forgot request 1"].is_set()  # ... b then deleted it
    assert store.add(ex + "requests", 0) == 2  # asked again, as request 2
    wait_for(lambda: a.metrics()[waiting] == "0", what="a to be done with request 1")
    # a's answer to request 1 landed after b deleted its keys, and went.
    for n in (1, 2):
        assert not store.check([f"{ex}request/{n}"]), n
        assert not store.check([f"{ex}sealed/{n}"]), n
    for g in (b, a):
        g.stop()


def test_an_idle_member_writes_nothing_to_a_file_store_between_its_renewals(tmp_path):
    """A FileStore appends every write to its file, which never shrinks,
    and a group keeps its store for as long as it lives. Between two
    renewals of its lease an idle member only reads. Before, its watcher
    read two counters with add(key, 0) every turn, and a FileStore appends
    each add: about 500 bytes a second per member, for good."""
    path = str(tmp_path / "store")
    store = dist.FileStore(path, -1)
    a = A.Group(store, "a", 0, 0, lease_s=60.0)  # renewed every 12 s
    a.join("addr-a")
    b = A.Group(dist.FileStore(path, -1), "b", 1, 0, lease_s=60.0)
    b.join("addr-b")
    wait_for(lambda: a.epoch == 2, what="b's join applied by a")
    time.sleep(1.0)  # the join's acknowledgements and first renewals land
    size = os.path.getsize(path)
    time.sleep(2.0)  # ten turns of each watcher, idle
    assert os.path.getsize(path) == size
    for g in (b, a):
        g.stop()


def test_a_request_count_raised_by_anyone_costs_a_member_nothing_unbounded():
    """The requests counter proves nothing: anyone who can write the store
    can add to it. A member lists the newest 256 counted requests at most.
    Before, it listed every number from its last up to the count, and one
    raise by 10^12 had every member's watcher loop there until it ran out
    of memory (and stop renewing its lease: the group died). Now the
    member goes on renewing its lease and sealing for real joiners."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=1.0)
    first = a.join("addr-a")
    store.add("torch_rpc_ext/dyn_secret/0/requests", 10**12)
    time.sleep(2.0)  # two of a's leases: it must have renewed it meanwhile
    # A joiner is served by a (its request counted after the raised ones,
    # so the newest): had a's watcher stalled, its lease would have lapsed
    # and the joiner made a new group with another secret.
    b = A.Group(store, "b", 1, 0, lease_s=1.0)
    assert b.join("addr-b") == first
    b.stop()
    a.stop()


def test_a_joiner_judges_members_alive_by_their_own_lease_not_its_own():
    """A member of an 8 s lease (a renewal every 1.6 s) that has not sealed
    the secret for a joiner of 0.2 s (here frozen: its watcher stopped, as
    a stopped process's is) is alive to that joiner for its own 8 s, as the
    members judge each other: the joiner waits rather than end the epoch
    and make a second secret for a group that still has a live member.
    Once that member's lease has lapsed, the joiner starts over. Before,
    the joiner judged by its own 0.2 s and ended the epoch within a
    second. (8 s, not 4: the joiner sees a lapsed 8 s after it first saw
    its beat, so the check at 2.5 s has over 5 s to spare on a loaded
    host.)"""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=8.0)
    first = a.join("addr-a")
    a.freeze()
    b = A.Group(store, "b", 1, 0, lease_s=0.2)
    got = []
    joiner = threading.Thread(target=lambda: got.append(b.join("addr-b")), daemon=True)
    joiner.start()
    time.sleep(2.5)  # a dozen of the joiner's leases, within the member's
    assert store.add("torch_rpc_ext/dyn_secret/epoch", 0) == 0
    assert not got
    joiner.join(30)
    assert got and len(got[0]) == 32 and got[0] != first  # a lapsed: a new group
    assert store.add("torch_rpc_ext/dyn_secret/epoch", 0) == 1
    b.stop()
    a.stop()


def _join_and_die(port, out):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    a = A.Group(store, "a", 0, 0, lease_s=1.0)
    out.put(a.join("addr-a"))
    time.sleep(0.5)
    os._exit(0)  # no leave: still listed, its lease lapses


def test_a_group_whose_members_died_without_leaving_starts_over_after_their_leases():
    import multiprocessing

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_join_and_die, args=(server.port, out))
    p.start()
    first = out.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    store = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    c = A.Group(store, "c", 2, 0, lease_s=1.0)
    t0 = time.monotonic()
    renewed = c.join("addr-c")
    assert renewed != first and time.monotonic() - t0 < 20
    c.stop()


def test_a_maker_that_never_joined_is_given_up_on():
    store = dist.HashStore()
    # Someone won epoch 0's maker key and was never seen again.
    store.compare_set("torch_rpc_ext/dyn_secret/0/maker", "", b"m" * 32)
    c = A.Group(store, "c", 2, 0, lease_s=1.0)
    t0 = time.monotonic()
    assert len(c.join("addr-c")) == 32
    assert time.monotonic() - t0 < 20
    assert store.add("torch_rpc_ext/dyn_secret/epoch", 0) == 1
    c.stop()


def test_a_record_over_the_logs_bound_is_named_by_its_size(capfd):
    """A record over 64 KiB is passed over as a store writer's, and the
    warning says its size (it said it carried no proof, which sent one
    looking for a wrong secret); a joiner whose own record would be that
    large (device maps to thousands of workers) fails init_rpc saying so,
    rather than append a record every member passes over ("the group did
    not take our join")."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0, secret=KEY)
    a.join("addr-a")
    big = b"join 00000000000000bb 1 big 2000\n" + b"x" * 70000
    assert store.compare_set(E0 + "log/2", b"", big) == big
    wait_for(lambda: a.epoch == 2, what="the large record passed over")
    assert f"is {len(big)} bytes, over the log's bound" in capfd.readouterr().err
    assert a.metrics()["rpc_ext.membership.unproven_records"] == "1"
    assert [m[:2] for m in a.members()] == [(0, "a")] and not a.fenced
    maps = "".join(f"devicemap worker{i} 0:0\n" for i in range(4000))
    b = A.Group(store, "b", 1, 0, lease_s=2.0, secret=KEY)
    with pytest.raises(RuntimeError, match=r"its join record would be \d+ bytes \(its devices "
                                            r"and device maps.*bound of 65536 bytes"):
        b.join("devices 0\n" + maps)
    b.stop()
    assert a.epoch == 2 and t.log_read(store, 3, prefix=E0) is None
    a.stop()


# ---- What a store writer leaves in the log, and joiners that die (session 93) ----

def _join_on_a_thread(g, offers, timeout):
    """g.join(offers) on a thread: its result, or the exception it raised;
    None where it had not returned after `timeout` s (before session 93 a
    joiner could spin for good there)."""
    out = []

    def run():
        try:
            out.append(g.join(offers))
        except Exception as e:  # returned to the test
            out.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    return out[0] if out else None


def test_a_log_slot_holding_the_text_an_empty_read_used_is_passed_over(monkeypatch):
    """A key reads as empty when a compareSet expecting a text no key holds
    gives that text back (store_bytes.h, peekKey). The text was fixed
    ("\\0absent"): a store writer that put it in the log's next slot made
    the slot read as empty for good, so every member stopped there, and a
    joiner, whose record went in the slot after, read the empty one again
    and again without end, holding the roster. The text is drawn at random
    per process now: the slot is a writer's garbage, passed over."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=1.0, secret=KEY)
    secret = a.join("addr-a")
    store.set(E0 + "log/2", b"\x00absent")
    b = A.Group(store, "b", 1, 0, lease_s=1.0, secret=KEY, rendezvous_s=5.0)
    assert _join_on_a_thread(b, "addr-b", 15) == secret
    assert b.epoch == 3 and t.log_read(store, 3, prefix=E0) is not None
    wait_for(lambda: a.epoch == 3, what="a past the garbage, at b's join")
    assert [m[:2] for m in a.members()] == [(0, "a"), (1, "b")]
    assert a.metrics()["rpc_ext.membership.unproven_records"] == "1"
    b.stop()
    a.stop()


class _LosesTheSlotBeforeItsJoin(_PassThroughStore):
    """A joiner's store whose writer fills the log slot the joiner is about
    to claim with garbage, then deletes it once the joiner's record is in
    the next one: the joiner's record follows a slot that reads empty."""

    def __init__(self, inner):
        super().__init__(inner)
        self.done = False

    def compare_set(self, key, expected, desired):
        if not self.done and key == E0 + "log/2" and expected == b"" and desired.startswith(b"proof "):
            self.inner.set(E0 + "log/2", b"a writer's garbage")
        got = self.inner.compare_set(key, expected, desired)
        if not self.done and key == E0 + "log/3" and got == desired:
            self.inner.delete_key(E0 + "log/2")
            self.done = True
        return got


def test_a_join_after_a_slot_the_store_lost_fails_naming_it():
    """A record deleted from the log before everyone read it: nobody reads
    past that slot. A joiner whose record lies past it fails init_rpc at
    its deadline, naming the slot and why, rather than read it for good
    (before: an endless loop holding the roster)."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=0.5, secret=KEY)
    secret = a.join("addr-a")
    losing = _LosesTheSlotBeforeItsJoin(store)  # held: the group calls it
    b = A.Group(losing, "b", 1, 0, lease_s=0.5, secret=KEY, rendezvous_s=1.0)
    t0 = time.monotonic()
    err = _join_on_a_thread(b, "addr-b", 20)
    assert isinstance(err, RuntimeError), err
    assert time.monotonic() - t0 < 10
    assert "its join is record 3 of the group's membership log, and record 2 reads empty" in str(err)
    assert "deleted or written over" in str(err)
    # Its join taken back after it, not in the hole before it: there, the
    # members would have read the leave (of a non-member, passed over)
    # and then the join, and counted a member with nobody behind it.
    assert t.log_read(store, 2, prefix=E0) is None
    body, proven = t.log_read(store, 4, secret, E0)
    assert body == f"leave {b.incarnation:016x}".encode() and proven
    time.sleep(0.5)  # turns of a's watcher: still at the hole
    assert a.epoch == 1 and [m[:2] for m in a.members()] == [(0, "a")]
    b.stop()
    a.stop()


def test_each_snapshot_is_written_where_the_members_cross_a_multiple(monkeypatch):
    """Snapshots every 4 epochs here: the members write one as they cross
    4, and nobody writes one at the epoch it joined at. Before, a joiner
    wrote a snapshot of the whole roster on its first turn (its count of
    snapshots written started at 0), whatever its epoch: in a large group
    one copy of every member's join record per join, each moving the
    pointer and deleting the one before."""
    monkeypatch.setenv("TORCH_RPC_EXT_LOG_SNAPSHOT_EVERY", "4")
    store = dist.HashStore()
    groups = []
    for i, name in enumerate("abcde"):
        g = A.Group(store, name, i, 0, lease_s=2.0, secret=KEY)
        g.join(f"addr-{name}")
        groups.append(g)
    wait_for(lambda: all(g.epoch == 5 for g in groups), what="every join applied")
    # (a, b and c applied d's join, the 4th, before e's was appended: d's
    # init_rpc waited for their acknowledgements.)
    wait_for(lambda: store.check([E0 + "snap/latest"]) and store.get(E0 + "snap/latest") == b"4 0",
             what="the snapshot at 4")

    def beats(g):  # its lease counter: raised in a turn, before that turn's snapshot step
        return int(store.get(f"{E0}beat/{g.incarnation:016x}").rsplit(b"\n", 1)[-1])

    renewed = beats(groups[-1])
    wait_for(lambda: beats(groups[-1]) >= renewed + 2, what="two more turns of e's watcher")
    assert [e for e in range(1, 7) if store.check([f"{E0}snap/{e}"])] == [4]
    assert store.get(E0 + "snap/latest") == b"4 0"
    for g in groups:
        g.stop()


class _FailsRaisingTheEpoch(_PassThroughStore):
    """A joiner's store that fails (a connection reset, say) as it raises
    the group-made secret's epoch counter with add()."""

    def add(self, key, n):
        if key == "torch_rpc_ext/dyn_secret/epoch":
            raise RuntimeError("connection reset by the store's host")
        return self.inner.add(key, n)


def test_a_joiner_that_failed_ending_an_empty_groups_epoch_holds_up_nobody():
    """Ending the epoch of a group with nobody alive took two steps: a
    compareSet of ".../<e>/ended", then add() on the counter. A joiner that
    died or lost the store in between left "ended" claimed and the counter
    where it was: every later joiner waited out its timeout on an epoch
    that nobody could end any more. It is one compareSet on the counter
    now, which the failing add() here never reaches."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=0.5)
    first = a.join("addr-a")
    a.leave()
    a.stop()
    failing = _FailsRaisingTheEpoch(store)  # held: the group calls it
    c = A.Group(failing, "c", 2, 0, lease_s=0.5, rendezvous_s=5.0)
    got = _join_on_a_thread(c, "addr-c", 20)  # (before: the store's error)
    d = A.Group(store, "d", 3, 0, lease_s=0.5, rendezvous_s=5.0)
    t0 = time.monotonic()
    joined = _join_on_a_thread(d, "addr-d", 20)  # (before: timed out after 5 s)
    assert isinstance(joined, bytes) and time.monotonic() - t0 < 5, joined
    assert joined == got != first  # c made the new group, and sealed it to d
    assert store.get("torch_rpc_ext/dyn_secret/epoch") == b"1"
    d.stop()
    c.stop()


# ---- the requests being served (serving_table.h) -----------------------------


def test_the_table_of_requests_being_served_lists_the_oldest_in_their_stages():
    """Oldest first, `limit` of them with how many in all; each in the stage
    its server last entered, with the Linux id of the thread that entered a
    stage that holds one (running, responding) and none otherwise; the
    server's mark of a handler that returned a future (waiting) only from
    running on its own thread; an entry removed is gone, and its node serves
    the next request."""
    table = t.agent.ServingTable()
    assert table.oldest(5) == ([], 0)
    for request in (7, 3, 9):
        table.add(request)
    assert table.oldest(2) == ([(7, "queued", 0), (3, "queued", 0)], 3)
    table.enter(3, "running")
    me = threading.get_native_id()
    assert table.oldest(5)[0][1] == (3, "running", me)
    seen = {}

    def respond_elsewhere():
        table.enter(9, "responding")
        seen["thread"] = threading.get_native_id()

    worker = threading.Thread(target=respond_elsewhere)
    worker.start()
    worker.join()
    assert seen["thread"] != me
    assert table.oldest(5)[0][2] == (9, "responding", seen["thread"])
    table.leave_running(3)  # its handler returned a future: no thread holds it
    assert table.oldest(5)[0][1] == (3, "waiting", 0)
    # Not if its work resumed on another thread first (running there).
    table.leave_running(9)
    assert table.oldest(5)[0][2] == (9, "responding", seen["thread"])
    table.add(5)
    resumed = threading.Thread(target=table.enter, args=(5, "running"))
    resumed.start()
    resumed.join()
    [(_, stage, thread)] = [e for e in table.oldest(5)[0] if e[0] == 5]
    table.leave_running(5)
    assert [e for e in table.oldest(5)[0] if e[0] == 5] == [(5, stage, thread)]
    assert stage == "running" and thread not in (0, me)
    table.remove(5)
    table.remove(7)
    table.add(11)  # (the node 7 left)
    assert table.oldest(5) == ([(3, "waiting", 0), (9, "responding", seen["thread"]),
                                (11, "queued", 0)], 3)
    for request in (3, 9, 11):
        table.remove(request)
    assert table.oldest(5) == ([], 0)
    table.add(1)
    with pytest.raises(ValueError, match="no stage named asleep"):
        table.enter(1, "asleep")


def test_the_table_of_requests_being_served_holds_under_threads_at_once():
    """Four threads serving 20,000 requests each through one table leave it
    empty (ThreadSanitizer runs this file too); what one costs is in
    docs/performance.md."""
    ns, left = t.agent.serving_table_cost(20000, 4)
    assert ns > 0 and left == 0
