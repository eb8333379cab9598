# SPDX-License-Identifier: BSD-3-Clause
"""Dynamic groups (init_rpc without world_size; docs/elastic.md): workers join
a running group under load, leave while others keep calling, die and are
declared dead, and their name and rank are taken again; a join that fails
leaves the group able to take the next one."""

import os
import signal
import tempfile
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

import torch_rpc_ext
from tests.rpc.world import options, run_world

pytestmark = pytest.mark.timeout(180)

_ctx = mp.get_context("fork")


def join(rank, store_path, **kwargs):
    """init_rpc as worker{rank} into the dynamic group kept in ``store_path``."""
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=options(init_method=f"file://{store_path}", **kwargs),
    )


def join_with_world_size_0(rank, world_size, store_path):
    # world_size=0 is a dynamic group, as upstream's init_rpc takes it: the
    # backend took it as static (no membership thread, no callbacks) while
    # torch made a dynamic group's store.
    seen = []
    torch_rpc_ext.on_membership_change(seen.append)
    rpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=0,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=options(init_method=f"file://{store_path}"),
    )
    wait_for(lambda: members() == ["worker0", "worker1"], what="both members")
    out = {"sum": rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), rank))}
    rpc.api._barrier(["worker0", "worker1"])
    rpc.shutdown()
    # Read once shutdown has run the callbacks up to this worker's own leave
    # (read before, a loaded host's callback thread could still be behind
    # the join members() already showed, and a worker that joined second
    # sees no join at all).
    out["events"] = bool(seen) if rank == 0 else None
    return out


def test_world_size_0_makes_a_dynamic_group(store_path):
    res = run_world(join_with_world_size_0, 2, timeout=120, store_path=store_path)
    assert float(res[0]["sum"]) == 1.0 and float(res[1]["sum"]) == 2.0, res
    assert res[0]["events"], res


def members():
    return sorted(m.name for m in torch_rpc_ext.membership().members)


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def add(a, b):
    return a + b


def getpid():
    return os.getpid()


@pytest.fixture
def store_path():
    with tempfile.TemporaryDirectory() as d:
        yield os.path.join(d, "store")


# ---- join under load, graceful leave, callbacks --------------------------


def _join_and_leave(rank, world_size, store_path, gates):
    out = {}
    events = []
    # A slow callback first: the list below gets each event 0.2 s after it
    # was applied, so only a shutdown that waits for the callbacks sees its
    # own leave there.
    torch_rpc_ext.on_membership_change(lambda e: time.sleep(0.2))
    torch_rpc_ext.on_membership_change(events.append)
    if rank == 0:
        join(0, store_path)
        gates["0"].set()
        gates["1"].wait(30)
        wait_for(lambda: "worker1" in members(), what="worker1")
        # Calls to worker1 keep flowing while worker2 joins.
        stop = threading.Event()
        answers = []

        def load():
            while not stop.is_set():
                futs = [rpc.rpc_async("worker1", add, (i, 1)) for i in range(8)]
                answers.extend(f.wait() - i for i, f in enumerate(futs))

        loader = threading.Thread(target=load)
        loader.start()
        gates["go2"].set()
        gates["2"].wait(30)
        stop.set()
        loader.join()
        out["load"] = (len(answers), set(answers))
        # worker2's init_rpc has returned: we can call it at once.
        out["to2"] = rpc.rpc_sync("worker2", add, (40, 2))
        gates["called"].wait(30)  # worker2 has called worker1
        gates["leave1"].set()
        wait_for(lambda: "worker1" not in members(), what="worker1 to leave")
        try:
            rpc.rpc_sync("worker1", add, (1, 1))
        except RuntimeError as e:
            out["after_leave"] = str(e)
        out["to2_after"] = rpc.rpc_sync("worker2", add, (1, 1))
        out["members"] = members()
        metrics = rpc.api._get_current_rpc_agent().get_metrics()
        out["epoch_metric"] = int(metrics["rpc_ext.membership.epoch"])
        out["peer_keys"] = sorted(k for k in metrics if k.endswith(".calls_sent"))
        gates["done0"].set()
        gates["done2"].wait(30)
    elif rank == 1:
        gates["0"].wait(30)
        join(1, store_path)
        gates["1"].set()
        gates["leave1"].wait(60)
    else:
        gates["go2"].wait(30)
        join(2, store_path)
        gates["2"].set()
        out["from2"] = [rpc.rpc_sync(f"worker{r}", add, (r, 10)) for r in (0, 1)]
        gates["called"].set()
        gates["done0"].wait(60)
        gates["done2"].set()
    rpc.shutdown()  # returns once the callbacks have seen our own leave
    out["events"] = [(e.kind, e.name) for e in events]
    return out


def test_join_under_load_and_graceful_leave(store_path):
    gates = {
        k: _ctx.Event() for k in ("0", "1", "go2", "2", "called", "leave1", "done0", "done2")
    }
    res = run_world(_join_and_leave, 3, timeout=120, store_path=store_path, gates=gates)
    count, values = res[0]["load"]
    assert count > 0 and values == {1}
    assert res[0]["to2"] == 42 and res[2]["from2"] == [10, 11]
    assert "worker1 left the group" in res[0]["after_leave"]
    assert res[0]["to2_after"] == 2
    assert res[0]["members"] == ["worker0", "worker2"]
    # Three joins and a leave: epoch 4; worker1's counters stay listed.
    assert res[0]["epoch_metric"] == 4
    assert res[0]["peer_keys"] == [f"rpc_ext.peer.worker{r}.calls_sent" for r in range(3)]
    # Each change once, after our own join (worker0 then sees 1, 2 join, 1 leave,
    # and 2 leave if it left first).
    ev0 = res[0]["events"]
    assert ev0[:3] == [("join", "worker1"), ("join", "worker2"), ("leave", "worker1")]
    assert len(ev0) == len(set(ev0))
    assert res[2]["events"][0] == ("leave", "worker1")
    # Each one's last event is its own leave, seen before rpc.shutdown()
    # returned.
    for rank in range(3):
        assert res[rank]["events"][-1] == ("leave", f"worker{rank}"), res[rank]["events"]


# ---- SIGKILL: declared dead, then replaced -------------------------------


def _owned_value(v):
    return torch.tensor([v])


_kept = []  # an RRef a worker holds until it dies


def _hold(rref):
    _kept.append(rref)


def _make_owned(v):
    return rpc.RRef(torch.tensor([v]))  # ours, forked to the caller


def _rref_ids(rref):
    # "UserRRef(RRefId = GloballyUniqueId(created_on=1, local_id=0), ForkId = ...)"
    return repr(rref).split("ForkId")[0]


def _owner_counts():
    info = rpc._rref_context_get_debug_info()
    return int(info["num_owner_rrefs"]), int(info["num_forks"])


def _autograd_contexts():
    import torch.distributed.autograd as dist_autograd

    return int(dist_autograd._get_debug_info()["num_autograd_contexts"])


def _kill_and_replace(rank, world_size, store_path, gates):
    out = {}
    if rank == 0:
        dead = []
        torch_rpc_ext.on_membership_change(
            lambda e: dead.append((e.name, e.reason)) if e.kind == "dead" else None
        )
        join(0, store_path, heartbeat_timeout=1.0)
        baseline = _owner_counts()
        gates["0"].set()
        gates["1"].wait(30)
        wait_for(lambda: "worker1" in members(), what="worker1")
        # An RRef of ours that we fork to worker1 ourselves (no fork request
        # tells us who holds it: the message that carries it does).
        own = rpc.RRef(torch.tensor([7]))
        rpc.rpc_sync("worker1", _hold, (own,))
        out["owning_for_1"] = _owner_counts()
        out["contexts_for_1"] = _autograd_contexts()
        rref = rpc.remote("worker1", _owned_value, (3,))
        assert rref.to_here().item() == 3
        pending = rpc.rpc_async("worker1", time.sleep, (30,))
        pid = rpc.rpc_sync("worker1", getpid)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            pending.wait()
        except RuntimeError as e:
            out["pending"] = str(e)
        wait_for(lambda: "worker1" not in members(), what="worker1 declared dead")
        out["declared_s"] = time.monotonic() - t0
        # What the dead worker held of ours is released.
        wait_for(lambda: _owner_counts() == baseline, what="worker1's forks dropped")
        # (Counted just after torch drops them: both, before the counter is read.)
        wait_for(lambda: _autograd_contexts() == 0 and int(
            rpc.api._get_current_rpc_agent().get_metrics()[
                "rpc_ext.membership.dropped_autograd_contexts"]) > 0,
            what="worker1's autograd context dropped")
        metrics = rpc.api._get_current_rpc_agent().get_metrics()
        out["dropped"] = int(metrics["rpc_ext.membership.dropped_forks"])
        out["dropped_contexts"] = int(metrics["rpc_ext.membership.dropped_autograd_contexts"])
        out["changes"] = {k: int(metrics[f"rpc_ext.membership.{k}"])
                          for k in ("joins", "leaves", "deaths", "lease_lapses")}
        # Membership callbacks run on a thread of their own, after the view
        # changed: under load the event may come after the checks above.
        wait_for(lambda: dead, what="the dead event's callback")
        out["dead"] = list(dead)
        try:
            rpc.rpc_sync("worker1", add, (1, 1))
        except RuntimeError as e:
            out["new_call"] = str(e)
        # worker1's WorkerInfo, looked up (and kept) for the calls above, is
        # not handed out once the view without it is published.
        try:
            out["info_after_death"] = rpc.get_worker_info("worker1")
        except RuntimeError as e:
            out["info_after_death"] = str(e)
        try:
            rref.to_here()
        except RuntimeError as e:
            out["rref"] = str(e)
        gates["replace"].set()
        gates["replaced"].wait(60)
        out["replacement"] = rpc.rpc_sync("worker1", add, (100, 1))
        out["replacement_pid_differs"] = rpc.rpc_sync("worker1", getpid) != pid
        # The dead worker's RRef, asked of the new worker1: refused at once
        # (upstream's owner would wait for a value that never comes).
        t0 = time.monotonic()
        try:
            rref.to_here()
        except RuntimeError as e:
            out["stale"] = (str(e), time.monotonic() - t0)
        del rref  # its deletion is not sent to the new worker1 either
        gates["done"].set()
        rpc.shutdown()
    elif rank == 1:
        gates["0"].wait(30)
        join(1, store_path, heartbeat_timeout=1.0)
        # An RRef owned by worker0, held until this process is killed.
        _kept.append(rpc.remote("worker0", _owned_value, (3,)))
        assert _kept[0].to_here().item() == 3
        # One worker0 creates and returns: forked to us in its response.
        _kept.append(rpc.rpc_sync("worker0", _make_owned, (5,)))
        # A forward pass into worker0 under a context this process never
        # releases: worker0 holds the context until it learns of the death.
        import torch.distributed.autograd as dist_autograd

        context = dist_autograd.context()
        context.__enter__()
        _kept.append(context)
        rpc.rpc_sync("worker0", torch.add, (torch.ones(2, requires_grad=True), 1))
        gates["ids1"].put(_rref_ids(_kept[0]))
        gates["1"].set()
        time.sleep(120)  # killed by worker0
    else:
        gates["replace"].wait(60)
        join(1, store_path, heartbeat_timeout=1.0)  # the dead one's name and rank
        # The case: on TensorPipe the owner hands back the old
        # holder's value (3), since the new process reissues its RRef ids.
        fresh = rpc.remote("worker0", _owned_value, (101,))
        out["fresh"] = fresh.to_here().item()
        out["fresh_ids"] = _rref_ids(fresh)
        del fresh
        gates["replaced"].set()
        gates["done"].wait(60)
        rpc.shutdown()
    return out


def test_killed_member_is_declared_dead_and_replaced(store_path):
    gates = {k: _ctx.Event() for k in ("0", "1", "replace", "replaced", "done")}
    gates["ids1"] = _ctx.Queue()
    res = run_world(
        _kill_and_replace, 3, timeout=120, dies=frozenset({1}), store_path=store_path, gates=gates
    )
    out = res[0]
    # worker1's RRef, one worker0 returned to it and one worker0 passed it:
    # a fork each, all dropped when it died.
    assert out["owning_for_1"] == (3, 3)
    assert out["dropped"] == 3
    # Its autograd context on worker0, released when it was declared dead.
    assert out["contexts_for_1"] == 1 and out["dropped_contexts"] == 1
    # Membership counters (torch_rpc_ext_membership_changes_total,
    # torch_rpc_ext_lease_lapses_total): worker0's and worker1's joins, one
    # death after its lease lapsed (worker0 the only survivor to see it), no
    # leave.
    changes = out["changes"]
    assert changes["joins"] >= 2 and changes["deaths"] == 1 and changes["leaves"] == 0, changes
    assert changes["lease_lapses"] >= 1, changes
    assert res[2]["fresh"] == 101
    old_ids = gates["ids1"].get(timeout=5)
    assert "created_on=1" in old_ids and res[2]["fresh_ids"] != old_ids
    assert "worker1" in out["pending"]
    # The lease (heartbeat_timeout 1 s) runs out and a survivor records it.
    assert out["declared_s"] < 10, out["declared_s"]
    assert [name for name, _ in out["dead"]] == ["worker1"]
    assert "lease was not renewed" in out["dead"][0][1]
    assert "worker1 was declared dead" in out["new_call"]
    assert "worker1 was declared dead" in out["info_after_death"], out["info_after_death"]
    assert "worker1" in out["rref"]
    assert out["replacement"] == 101 and out["replacement_pid_differs"]
    stale, seconds = out["stale"]
    assert "previous holder of worker1" in stale and "declared dead" in stale
    assert seconds < 5, seconds


def _drop_during_the_stale_scan(rank, world_size, store_path, gates):
    out = {}
    if rank == 0:
        mark = store_path + ".paused"
        os.environ["TORCH_RPC_EXT_TEST_STALE_SCAN_PAUSE"] = f"2000:{mark}"
        join(0, store_path, heartbeat_timeout=1.0)
        gates["joined"].wait(30)
        wait_for(lambda: {"worker1", "worker2"} <= set(members()), what="the others")
        # Ours of worker2 (alive throughout), the only one the scan sees.
        live = rpc.remote("worker2", _owned_value, (3,))
        assert live.to_here().item() == 3
        os.kill(rpc.rpc_sync("worker1", getpid), signal.SIGKILL)
        # worker1 is declared dead: a scan of the RRefs we use, for those it
        # owned, holds a reference to worker2's while it looks (the hook
        # pauses it there).
        wait_for(lambda: os.path.exists(mark), what="the stale scan")
        del live  # ours was the last reference but the scan's
        # Torch's RRef lock is free again, and its calls work.
        out["after"] = rpc.remote("worker2", _owned_value, (5,)).to_here().item()
        gates["done"].set()
        rpc.shutdown()
    elif rank == 1:
        join(1, store_path, heartbeat_timeout=1.0)
        gates["joined"].set()
        time.sleep(120)  # killed by worker0
    else:
        gates["joined"].wait(30)
        join(2, store_path, heartbeat_timeout=1.0)
        gates["done"].wait(60)
        rpc.shutdown()
    return out


def test_an_rref_dropped_while_the_stale_scan_holds_it_deadlocks_nothing(store_path):
    """A member declared dead: the RRefs we use that it owned are marked
    stale by a scan of torch's RRef context under its lock, which holds a
    reference to each RRef alive while it looks at it, whoever owns it. A
    user thread that dropped its own meanwhile made the scan's the last: it
    deleted the RRef under that lock, which the deletion takes again once
    its message to a live owner is sent, and every RRef call of the process
    hung (helpers' readings in session 94). The scan keeps them until it
    has let the lock go."""
    gates = {k: _ctx.Event() for k in ("joined", "done")}
    res = run_world(_drop_during_the_stale_scan, 3, timeout=90, dies=frozenset({1}),
                    store_path=store_path, gates=gates)
    assert res[0]["after"] == 5


def _rref_once_caller_is_dead(pid):
    # Served for worker1, which we kill: the RRef we return is pickled after
    # its death was applied here, for a holder that is gone.
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: "worker1" not in members(), what="worker1 declared dead")
    return rpc.RRef(torch.tensor([9]))


def _late_forks(rank, world_size, store_path, gates):
    out = {}
    if rank == 0:
        join(0, store_path, heartbeat_timeout=1.0)
        baseline = _owner_counts()
        gates["0"].set()
        gates["joined"].wait(30)
        wait_for(lambda: "worker1" in members(), what="worker1")
        info = rpc.get_worker_info("worker1")  # kept: a call to it pickles its arguments
        gates["go"].set()
        wait_for(lambda: "worker1" not in members() and gates["1"].is_set(), what="worker1 gone")
        # An RRef of ours passed to the dead worker: the call fails, and the
        # fork pickled into it is held by nobody.
        own = rpc.RRef(torch.tensor([8]))
        try:
            rpc.rpc_sync(info, _hold, (own,))
        except RuntimeError as e:
            out["passed"] = str(e)
        del own

        def dropped():
            metrics = rpc.api._get_current_rpc_agent().get_metrics()
            return int(metrics["rpc_ext.membership.dropped_forks"])

        # Both (the response's once its function has returned and it is
        # written), or what there is after 10 s.
        try:
            wait_for(lambda: dropped() == 2 and _owner_counts() == baseline, timeout=10)
        except AssertionError:
            pass
        out["counts"] = (baseline, _owner_counts())
        out["dropped"] = dropped()
        rpc.shutdown()
    else:
        gates["0"].wait(30)
        join(1, store_path, heartbeat_timeout=1.0)
        gates["joined"].set()
        gates["go"].wait(30)
        gates["1"].set()  # first: the call's first step kills us
        rpc.rpc_async("worker0", _rref_once_caller_is_dead, (os.getpid(),))
        time.sleep(120)  # killed by worker0
    return out


def test_forks_for_a_holder_that_departed_before_they_were_sent_are_dropped(store_path):
    """An RRef of ours pickled for a member after its departure was applied
    here (the response to a call it made before it died; an argument of a
    call to it after) is held by nobody: the departure released what the
    member held before, and nothing ever will after. Both are dropped
    (before, the owner kept their values for good: `num_owner_rrefs` and
    `num_forks` stayed 2 past the baseline)."""
    gates = {k: _ctx.Event() for k in ("0", "joined", "go", "1")}
    res = run_world(_late_forks, 2, timeout=120, dies=frozenset({1}), store_path=store_path, gates=gates)
    out = res[0]
    assert "worker1 was declared dead" in out["passed"], out
    baseline, after = out["counts"]
    assert after == baseline, out
    assert out["dropped"] == 2, out


# ---- a failed join leaves nothing held; rank 0 may leave ----------------


def _failed_join_then_good(rank, world_size, store_path, gates):
    out = {}
    if rank == 0:
        join(0, store_path, heartbeat_timeout=2.0)
        gates["0"].set()
        gates["dup_tried"].wait(60)
        gates["1"].wait(60)
        out["after_dup"] = members()
        gates["leave0"].wait(60)
        rpc.shutdown()  # the first member leaves first; the others go on
    elif rank == 2:
        gates["0"].wait(30)
        t0 = time.monotonic()
        try:
            # worker0's name and rank, held by a live worker: the joiner
            # watches its lease for the holder's heartbeat_timeout (2 s),
            # not its own (1 s would misjudge it dead).
            rpc.init_rpc(
                "worker0",
                rank=0,
                backend=rpc.BackendType.TORCH_RPC_EXT,
                rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
                    init_method=f"file://{store_path}",
                    heartbeat_timeout=1.0,
                    address="127.0.0.1",
                ),
            )
            out["dup"] = "joined"
        except RuntimeError as e:
            out["dup"] = str(e)
        out["dup_s"] = time.monotonic() - t0
        gates["dup_tried"].set()
    else:
        gates["dup_tried"].wait(60)
        join(1, store_path)
        gates["1"].set()
        out["call0"] = rpc.rpc_sync("worker0", add, (2, 3))
        gates["leave0"].set()
        wait_for(lambda: members() == ["worker1"], what="worker0 to leave")
        try:
            rpc.rpc_sync("worker0", add, (1, 1))
        except RuntimeError as e:
            out["after0"] = str(e)
        out["self"] = rpc.rpc_sync("worker1", add, (1, 1))
        rpc.shutdown()
    return out


def test_failed_join_leaves_group_usable_and_rank0_leaves(store_path):
    gates = {k: _ctx.Event() for k in ("0", "1", "dup_tried", "leave0")}
    res = run_world(_failed_join_then_good, 3, timeout=120, store_path=store_path, gates=gates)
    assert "rank 0 is held by worker0" in res[2]["dup"] and "alive" in res[2]["dup"]
    assert res[0]["after_dup"] == ["worker0", "worker1"]
    assert res[1]["call0"] == 5
    assert "worker0 left the group" in res[1]["after0"]
    assert res[1]["self"] == 2


def _static_refuses_dynamic(rank, world_size, store_path, gates):
    # A dynamic group exists in the store: a static member is refused.
    if rank == 0:
        join(0, store_path)
        gates["0"].set()
        gates["tried"].wait(60)
        rpc.shutdown()
        return None
    gates["0"].wait(60)
    try:
        rpc.init_rpc(
            "worker1",
            rank=1,
            world_size=2,
            backend=rpc.BackendType.TORCH_RPC_EXT,
            rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
                init_method=f"file://{store_path}", rpc_timeout=5
            ),
        )
        out = "joined"
    except RuntimeError as e:
        out = str(e)
    gates["tried"].set()
    return out


def test_static_member_refused_by_dynamic_group(store_path):
    gates = {k: _ctx.Event() for k in ("0", "tried")}
    res = run_world(_static_refuses_dynamic, 2, timeout=60, store_path=store_path, gates=gates)
    assert "mixes statically and dynamically" in res[1]


# ---- a stalled holder is not taken over by a joiner ----------------------


def _stalled_holder(rank, world_size, store_path, gates):
    out = {}
    if rank == 0:
        join(0, store_path, heartbeat_timeout=1.0)
        gates["pid"].put(os.getpid())
        gates["tried"].wait(60)
        out["members"] = members()  # still ours: nobody took the rank
        rpc.shutdown()
    else:
        pid = gates["pid"].get(timeout=30)
        # The only member stops (as under a debugger, or a stalled host):
        # its lease lapses, but its kernel still accepts connections for it.
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(2.5, os.kill, (pid, signal.SIGCONT)).start()
        t0 = time.monotonic()
        try:
            join(0, store_path, heartbeat_timeout=1.0)
            out["joined"] = "joined"
            rpc.shutdown()
        except RuntimeError as e:
            out["joined"] = str(e)
        out["seconds"] = time.monotonic() - t0
        gates["tried"].set()
    return out


def test_joiner_does_not_declare_a_stalled_holder_dead(store_path):
    """A joiner that finds its rank held by a member whose lease lapsed
    probes the member's listener: a stopped process still answers, so the
    joiner waits (up to three more leases, as members do) rather than
    declaring it dead after one; once the holder resumes and renews its
    lease, the joiner is refused (holding nothing). Judged by the lease
    alone, it took over 1 s after the stop, while the holder lived."""
    gates = {"pid": _ctx.Queue(), "tried": _ctx.Event()}
    res = run_world(_stalled_holder, 2, timeout=120, store_path=store_path, gates=gates)
    assert "which is alive" in res[1]["joined"], res[1]
    assert res[0]["members"] == ["worker0"]


# ---- the log's snapshots: a joiner starts from the newest -----------------


def _snapshots(rank, world_size, store_path, gates):
    os.environ["TORCH_RPC_EXT_LOG_SNAPSHOT_EVERY"] = "4"
    out = {}
    if rank == 0:
        join(0, store_path)
        gates["0"].set()
        gates["churned"].wait(60)
        gates["2"].wait(60)
        out["members"] = members()
        out["call2"] = rpc.rpc_sync("worker2", add, (2, 2))
        gates["done"].set()
        rpc.shutdown()
    elif rank == 1:
        gates["0"].wait(30)
        for _ in range(4):  # 8 epochs: a join and a leave each
            join(1, store_path)
            rpc.rpc_sync("worker0", add, (1, 1))
            rpc.shutdown()
        join(1, store_path)
        gates["churned"].set()
        gates["done"].wait(60)
        rpc.shutdown()
    else:
        gates["churned"].wait(60)
        join(2, store_path)
        metrics = rpc.api._get_current_rpc_agent().get_metrics()
        out["start_epoch"] = int(metrics["rpc_ext.membership.start_epoch"])
        out["epoch"] = int(metrics["rpc_ext.membership.epoch"])
        out["members"] = members()
        out["calls"] = [rpc.rpc_sync(w, add, (3, 4)) for w in ("worker0", "worker1")]
        gates["2"].set()
        gates["done"].wait(60)
        rpc.shutdown()
    return out


def test_joiner_starts_from_the_logs_newest_snapshot(store_path):
    """Members write the roster as a snapshot every few epochs (4 here); a
    joiner reads the newest and only the records after it, and sees the
    same group as one replaying the whole log."""
    gates = {k: _ctx.Event() for k in ("0", "churned", "2", "done")}
    res = run_world(_snapshots, 3, timeout=120, store_path=store_path, gates=gates)
    w2 = res[2]
    assert w2["start_epoch"] >= 8, w2  # 1 + 8 + 1 epochs before it joined
    assert w2["epoch"] > w2["start_epoch"]
    assert w2["members"] == ["worker0", "worker1", "worker2"]
    assert w2["calls"] == [7, 7]
    assert res[0]["members"] == ["worker0", "worker1", "worker2"]
    assert res[0]["call2"] == 4


# ---- dist autograd and DistributedOptimizer with a late joiner ----------


class _Param:
    """A parameter kept on its owner, stepped through DistributedOptimizer."""

    def __init__(self):
        self.w = torch.ones(3, requires_grad=True)


_params = {}


def _make_param():
    p = _Param()
    _params["p"] = p
    return p.w


def _param_value():
    return _params["p"].w.detach().clone()


def _late_joiner_trains(rank, world_size, store_path, gates):
    import torch.distributed.autograd as dist_autograd
    from torch import optim
    from torch.distributed.optim import DistributedOptimizer

    if rank == 0:
        join(0, store_path)
        gates["0"].set()
        gates["trained"].wait(60)
        out = {"w": _param_value().tolist()}
        rpc.shutdown()
        return out
    # worker1 joins after worker0 has been running, owns nothing, and trains
    # a parameter that lives on worker0.
    gates["0"].wait(30)
    time.sleep(0.2)
    join(1, store_path)
    w = rpc.remote("worker0", _make_param)
    opt = DistributedOptimizer(optim.SGD, [w], lr=0.5)
    losses = []
    for _ in range(3):
        with dist_autograd.context() as ctx:
            remote_w = w.remote().__mul__(1.0)  # an op on the owner
            loss = (remote_w.to_here() * 2).sum()
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
            losses.append(loss.item())
    gates["trained"].set()
    rpc.shutdown()
    return {"losses": losses}


def test_dist_autograd_and_optimizer_with_a_late_joiner(store_path):
    gates = {k: _ctx.Event() for k in ("0", "trained")}
    res = run_world(_late_joiner_trains, 2, timeout=120, store_path=store_path, gates=gates)
    # d(loss)/dw = 2 per element; SGD lr 0.5: w goes 1 -> 0 -> -1 -> -2.
    assert res[1]["losses"] == [6.0, 0.0, -6.0]
    assert res[0]["w"] == [-2.0, -2.0, -2.0]


# ---- incarnations in the handshake ---------------------------------------

_SECRET = b"elastic-test-secret-0123456789ab"


def _listen_address():
    return rpc.api._get_current_rpc_agent().get_debug_info()["rpc_ext.listen.tcp"]


def _handshakes(rank, world_size, store_path, gates):
    from torch_rpc_ext import _testing
    from torch_rpc_ext.testing import closed_by_peer, handshake

    out = {}
    if rank == 1:
        # Another passphrase first: refused by the member that answers, at
        # once and saying so; then the group's, in the same process.
        gates["0"].wait(30)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as refused:
            join(rank, store_path, secret=_SECRET[::-1])
        out["wrong"] = (str(refused.value), time.monotonic() - t0)
    join(rank, store_path, secret=_SECRET)
    # What the handshakes prove: the secret the group made, which its
    # passphrase admitted us to (not the passphrase: session 110).
    secret = _testing.agent.group_secret()
    out["secret_is_made"] = len(secret) == 32 and secret != _SECRET
    if rank == 0:
        gates["0"].set()
        gates["1"].wait(30)
        refused = rpc.api._get_current_rpc_agent().get_metrics()
        out["refused"] = refused["rpc_ext.membership.secret_proofs_refused"]
        wait_for(lambda: "worker1" in members(), what="worker1")
        addr = rpc.rpc_sync("worker1", _listen_address)
        mine = rpc.api._get_current_rpc_agent().incarnation
        for label, client_id, inc in [
            ("current", 0, mine),  # us, as we are: admitted
            ("stale", 0, mine ^ 1),  # our id, another incarnation
            ("absent", 5, mine),  # an id nobody holds
        ]:
            sock, proof_ok = handshake(
                addr, secret, client_id=client_id, incarnation=inc, stretch=False)
            # A refusal's close is waited for 3 s (a loaded host; with
            # handshake()'s own wait, under the 10 s handshake timeout that
            # would close a peer neither admitted nor refused), an
            # admission's staying open for a second.
            sock.settimeout(1.0 if label == "current" else 3.0)
            out[label] = (proof_ok, closed_by_peer(sock))
            sock.close()
        gates["done"].set()
    else:
        gates["1"].set()
        gates["done"].wait(60)
    rpc.shutdown()
    return out


def test_handshake_admits_only_current_incarnations(store_path):
    gates = {k: _ctx.Event() for k in ("0", "1", "done")}
    res = run_world(_handshakes, 2, timeout=60, store_path=store_path, gates=gates)
    said, took = res[1]["wrong"]
    assert "refused our proof of the group's passphrase" in said and took < 10, res[1]
    assert res[0]["refused"] == "1"
    # The secret is right every time, but the client proves first: a server
    # that refuses who it is closes without a proof of its own.
    assert res[0]["secret_is_made"] and res[1]["secret_is_made"]
    assert res[0]["current"] == (True, False)
    assert res[0]["stale"] == (False, True)
    assert res[0]["absent"] == (False, True)


# ---- an external store: no rank is special -------------------------------


def _host_store(port, ready, stop):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ready.set()
    stop.wait(120)
    del store


def _external_store(rank, world_size, port, gates):
    # Every worker is a client of a store it does not host (torch's
    # rendezvous does this under torchrun, or with this variable).
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    os.environ["MASTER_PORT"] = str(port)
    gates["store"].wait(30)
    out = {}
    options = torch_rpc_ext.RpcExtBackendOptions(
        init_method="env://", rpc_timeout=30, address="127.0.0.1"
    )

    def join_env(r):
        rpc.init_rpc(f"worker{r}", rank=r, backend=rpc.BackendType.TORCH_RPC_EXT,
                     rpc_backend_options=options)

    if rank == 0:
        join_env(0)
        gates["0"].set()
        gates["1"].wait(30)
        rpc.shutdown()  # rank 0, the first member, leaves first
        gates["0left"].set()
    elif rank == 1:
        gates["0"].wait(30)
        join_env(1)
        gates["1"].set()
        gates["0left"].wait(30)
        wait_for(lambda: members() == ["worker1"], what="worker0 to leave")
        gates["go2"].set()
        gates["2"].wait(30)
        out["to2"] = rpc.rpc_sync("worker2", add, (20, 2))
        gates["done"].wait(30)
        rpc.shutdown()
    else:
        gates["go2"].wait(60)
        join_env(2)  # joins after rank 0 left: nobody hosts anything
        gates["2"].set()
        out["to1"] = rpc.rpc_sync("worker1", add, (10, 1))
        out["members"] = members()
        gates["done"].set()
        rpc.shutdown()
    return out


def test_rank0_leaves_and_others_join_with_an_external_store():
    from tests.rpc.world import free_port

    port = free_port()
    ready, stop = _ctx.Event(), _ctx.Event()
    host = _ctx.Process(target=_host_store, args=(port, ready, stop))
    host.start()
    try:
        gates = {k: _ctx.Event() for k in ("0", "1", "0left", "go2", "2", "done")}
        gates["store"] = ready
        res = run_world(_external_store, 3, timeout=90, port=port, gates=gates)
    finally:
        stop.set()
        host.join(10)
        if host.is_alive():
            host.kill()
    assert res[1]["to2"] == 22 and res[2]["to1"] == 11
    assert res[2]["members"] == ["worker1", "worker2"]


# ---- the same process joins again after shutdown() -----------------------


def _rejoin(rank, world_size, store_path, gates):
    out = {}
    if rank == 1:
        join(1, store_path)
        gates["1"].set()
        gates["0done"].wait(60)
        wait_for(lambda: members() == ["worker1"], what="worker0 to leave")
        # Whatever worker0 held of ours went with it, both sessions.
        wait_for(lambda: _owner_counts() == (0, 0), what="worker0's forks released")
        rpc.shutdown()
        return out
    gates["1"].wait(30)
    values = []
    for session in range(2):
        join(0, store_path)
        values.append(rpc.rpc_sync("worker1", add, (session, 1)))
        rref = rpc.remote("worker1", _owned_value, (10 + session,))
        values.append(rref.to_here().item())
        out[f"ids{session}"] = _rref_ids(rref)
        out[f"epoch{session}"] = torch_rpc_ext.membership().epoch
        rpc.shutdown()
    out["values"] = values
    gates["0done"].set()
    return out


def test_same_process_joins_again_after_shutdown(store_path):
    gates = {k: _ctx.Event() for k in ("1", "0done")}
    res = run_world(_rejoin, 2, timeout=90, store_path=store_path, gates=gates)
    out = res[0]
    assert out["values"] == [1, 10, 2, 11]
    # Joined twice (a new incarnation, fresh RRef ids), after its own leave.
    assert out["epoch1"] > out["epoch0"]
    assert out["ids0"] != out["ids1"]


# ---- churn: benchmarks/elastic_soak.py in a short run --------------------


@pytest.mark.timeout(240)
def test_elastic_soak_short_run_loses_nothing():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "elastic_soak.py"), "--workers", "4",
         "--duration", "12", "--period", "1.5", "--backend", "TORCH_RPC_EXT"],
        capture_output=True, text=True, timeout=200, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["churn"]["kill"] + row["churn"]["leave"] >= 3, row
    assert row["ok"] > 0 and row["steps"] > 0, row
    # Nothing corrupted, every failure names the member it was for, every
    # replacement joined, nobody hung.
    assert row["wrong"] == 0 and row["unnamed"] == 0, row
    assert row["init_errors"] == 0 and not row["shutdown_errors"], row
    assert row["hung_at_end"] == [], row


# ---- an RRef passed on by a member that then leaves ----------------------

_held = []


def _keep(rref):
    _held.append(rref)
    return True


def _fetch_held():
    return _held[0].to_here().item()


def _passed_on(rank, world_size, store_path, gates):
    out = {}
    join(rank, store_path)
    if rank == 0:  # the owner
        gates["0"].set()
        wait_for(lambda: _owner_counts() == (1, 2), what="worker1's and worker2's forks")
        gates["forked"].set()
        wait_for(lambda: "worker1" not in members(), what="worker1 to leave")
        # worker1 forked worker2's fork, but worker2 holds it: it stays.
        time.sleep(0.5)
        out["after"] = _owner_counts()
        gates["check"].set()
        gates["done"].wait(60)
    elif rank == 1:  # creates the RRef, passes it on, leaves
        gates["0"].wait(30)
        gates["2"].wait(30)
        rref = rpc.remote("worker0", _owned_value, (7,))
        assert rpc.rpc_sync("worker2", _keep, (rref,))
        gates["forked"].wait(30)
        del rref
    else:  # holds it past its creator's departure
        gates["2"].set()
        gates["check"].wait(60)
        out["value"] = _fetch_held()
        _held.clear()
        gates["done"].set()
    rpc.shutdown()
    return out


def test_rref_passed_on_survives_its_creators_departure(store_path):
    gates = {k: _ctx.Event() for k in ("0", "2", "forked", "check", "done")}
    res = run_world(_passed_on, 3, timeout=90, store_path=store_path, gates=gates)
    assert res[0]["after"] == (1, 1)
    assert res[2]["value"] == 7
