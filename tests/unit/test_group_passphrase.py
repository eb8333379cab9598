"""A dynamic group given a passphrase by the user (session 110).

Until then such a group kept its membership log's proofs (records, leases,
acknowledgements) under a key drawn from the passphrase, so one record read
off the store's plain TCP let a tap test guesses offline. Now it runs on a
secret it makes, as a group without a passphrase does, and the passphrase
only admits joiners: each proves it to the member that answers, through the
store, by a password-authenticated exchange (csrc/agent/secret_seal.h).
These drive that exchange through the group's own code against a HashStore.
"""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from torch_rpc_ext import _testing as t

from .test_agent_parts import E0, KEY, _join_on_a_thread, _PassThroughStore, wait_for

A = t.agent
EX = "torch_rpc_ext/dyn_secret/0/"  # the exchange of epoch 0
STEPS = ("request", "sealed", "confirm", "answer")


def test_nothing_in_the_store_is_keyed_by_the_passphrase():
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0, secret=KEY)
    secret = a.join("addr-a")
    assert len(secret) == 32 and secret != KEY
    assert store.check([EX + "maker"])  # made, as without a passphrase
    b = A.Group(store, "b", 1, 0, lease_s=2.0, secret=KEY)
    assert b.join("addr-b") == secret
    for epoch in (1, 2):
        body, proven = t.log_read(store, epoch, secret, E0)
        assert proven and body.startswith(b"join ")
        # The passphrase proves none of them: nothing to test a guess by.
        assert t.log_read(store, epoch, KEY, E0) == (body, False)
    assert t.log_read(store, 1, KEY) is None  # no log at the root
    # b's exchange left the store once b was in.
    assert not any(store.check([f"{EX}{step}/1"]) for step in STEPS)
    assert a.metrics()["rpc_ext.membership.secret_proofs_refused"] == "0"
    for g in (b, a):
        g.stop()


def test_a_wrong_passphrase_is_refused_and_guessers_are_held_off(capfd):
    """Each wrong guess is refused as it is proven (the joiner fails at
    once, saying so). A member judges at most 8 at a time and, once it has
    refused 8 within 10 s, answers no joiner for 30 s: of 12 guessers at
    once, 8 are refused and the rest wait out their timeout (before the
    cap, a writer posting many requests at once had every one judged), and
    so does a right joiner meanwhile (the store cannot say who wrote a
    request)."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0, secret=KEY)
    a.join("addr-a")
    guessers = [A.Group(store, f"guess{i}", 1, 0, lease_s=0.5, secret=bytes([i]) * 32,
                        rendezvous_s=4.0) for i in range(12)]
    with ThreadPoolExecutor(len(guessers)) as pool:  # all at once
        said = [str(e) for e in pool.map(lambda g: _join_on_a_thread(g, "addr-g", 30), guessers)]
    refused = [m for m in said if "refused our proof of the group's passphrase" in m]
    assert len(refused) == 8, said
    assert all("timed out" in m for m in said if m not in refused), said
    for g in guessers:
        g.stop()
    m = a.metrics()
    assert m["rpc_ext.membership.secret_proofs_refused"] == "8"
    assert m["rpc_ext.membership.secret_hold_offs"] == "1"
    wait_for(lambda: a.metrics()["rpc_ext.membership.secret_held_off"] == "1",
             what="the hold-off shown")
    # Every guesser's exchange went with it.
    assert not any(store.check([f"{EX}{step}/{n}"]) for step in STEPS for n in range(1, 13))
    b = A.Group(store, "b", 1, 0, lease_s=0.5, secret=KEY, rendezvous_s=2.0)
    with pytest.raises(RuntimeError, match="timed out .*secret_held_off"):
        b.join("addr-b")
    b.stop()
    assert [m[:2] for m in a.members()] == [(0, "a")]
    assert "8 exchanges proving the group's passphrase were refused" in capfd.readouterr().err
    a.stop()


def test_a_flood_of_requests_nobody_confirms_shows_as_a_hold_off(capfd):
    """Requests written only to take a member's places (it has at most 8
    exchanges under way) each count as a strike once unconfirmed for 5 s:
    the flood shows as a hold-off in the metrics and the log, where before
    it kept every joiner waiting unseen, 8 requests per 10 s."""
    store = dist.HashStore()
    a = A.Group(store, "a", 0, 0, lease_s=2.0, secret=KEY)
    a.join("addr-a")
    for n in range(1, 21):
        store.set(f"{EX}request/{n}", os.urandom(16) + bytes(range(1, 33)))
    store.add(EX + "requests", 20)
    wait_for(lambda: a.metrics()["rpc_ext.membership.secret_hold_offs"] == "1", timeout=20,
             what="the hold-off")
    m = a.metrics()
    assert m["rpc_ext.membership.secret_proofs_refused"] == "0"  # none was judged
    assert m["rpc_ext.membership.secret_held_off"] == "1"
    assert sum(store.check([f"{EX}sealed/{n}"]) for n in range(1, 21)) == 8  # 8 offered
    assert "refused or left unconfirmed" in capfd.readouterr().err
    a.stop()


def test_a_joiner_confirms_to_at_most_three_answers_that_never_seal():
    """A store writer posing as a member answers a joiner's request with a
    share of its own guess and learns, from the joiner's confirmation,
    whether the guess was right; then it moves the epoch, and the joiner
    asks again there. A joiner stops after confirming to three answers that
    never sealed the secret, naming the likely cause (before, it confirmed
    a new guess every half second until its timeout)."""
    store = dist.HashStore()
    confirmed = []
    stop = threading.Event()

    # Epoch 0 has a maker before the joiner looks (else it makes the secret).
    store.compare_set("torch_rpc_ext/dyn_secret/0/maker", "", b"m" * 32)

    def impostor():
        epoch = 0
        while not stop.is_set():
            ex = f"torch_rpc_ext/dyn_secret/{epoch}/"
            for n in range(1, 4):
                if store.check([f"{ex}request/{n}"]) and not store.check([f"{ex}sealed/{n}"]):
                    store.compare_set(f"{ex}sealed/{n}", "", bytes(range(1, 33)))
                if store.check([f"{ex}confirm/{n}"]):
                    confirmed.append((epoch, n))
                    epoch = store.add("torch_rpc_ext/dyn_secret/epoch", 1)
                    store.compare_set(f"torch_rpc_ext/dyn_secret/{epoch}/maker", "", b"m" * 32)
                    break
            time.sleep(0.01)

    th = threading.Thread(target=impostor, daemon=True)
    th.start()
    b = A.Group(store, "b", 1, 0, lease_s=2.0, secret=KEY, rendezvous_s=60.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="3 answers in the rendezvous store took our proof"):
            b.join("addr-b")
    finally:
        stop.set()
        th.join(5)
    assert time.monotonic() - t0 < 20
    assert [e for e, _ in confirmed] == [0, 1, 2], confirmed
    b.stop()


def test_a_joiner_and_a_group_that_disagree_on_having_a_passphrase_are_told_so():
    for member, joiner, said in [
        (KEY, b"", "members were given a passphrase .* and this worker none"),
        (b"", KEY, "this worker was given a passphrase .* and the dynamic group's members none"),
    ]:
        store = dist.HashStore()
        a = A.Group(store, "a", 0, 0, lease_s=2.0, secret=member)
        a.join("addr-a")
        b = A.Group(store, "b", 1, 0, lease_s=2.0, secret=joiner)
        with pytest.raises(RuntimeError, match=said):
            b.join("addr-b")
        b.stop()
        assert a.metrics()["rpc_ext.membership.secret_proofs_refused"] == "0"
        a.stop()


class _LosesItsFirstAnswer(_PassThroughStore):
    """A member's store that drops its first answer to a joiner's proof, as
    a member that died between the joiner's confirmation and its answer."""

    def __init__(self, inner):
        super().__init__(inner)
        self.dropped = []

    def set(self, key, value):
        if key.startswith(EX + "answer/") and not self.dropped:
            self.dropped.append(key)
            return
        self.inner.set(key, value)


def test_a_joiner_whose_confirmation_went_unanswered_asks_again():
    """A joiner that confirmed to a member which never answered (it went)
    asks again under a new number after 10 s, and another turn of the
    exchange lets it in (before: it waited out its whole timeout)."""
    store = dist.HashStore()
    losing = _LosesItsFirstAnswer(store)  # held: the group calls it
    a = A.Group(losing, "a", 0, 0, lease_s=2.0, secret=KEY)
    secret = a.join("addr-a")
    b = A.Group(store, "b", 1, 0, lease_s=2.0, secret=KEY, rendezvous_s=30.0)
    t0 = time.monotonic()
    assert b.join("addr-b") == secret
    assert 10 <= time.monotonic() - t0 < 25
    assert losing.dropped == [EX + "answer/1"]
    assert not any(store.check([f"{EX}{step}/{n}"]) for step in STEPS for n in (1, 2))
    for g in (b, a):
        g.stop()
