# SPDX-License-Identifier: BSD-3-Clause
"""A peer killed with SIGKILL mid-call: pending calls fail at once (not at
rpc_timeout) naming the peer, new calls fail fast, survivors keep working."""

import os
import signal
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

from tests.rpc.world import init, run_world

pytestmark = pytest.mark.timeout(120)


def slow(seconds):
    time.sleep(seconds)
    return seconds


# The caller signals the peer itself once it has the pid: a timer in the
# peer could fire before a slow host had sent the answer (failing that
# call), and fires late on a loaded one; the caller knows when it signalled.
def getpid():
    return os.getpid()


def scenario(rank, world_size, done_with_2):
    init(rank, world_size, rpc_timeout=60)
    out = {}
    if rank == 0:
        try:
            pending = [rpc.rpc_async("worker1", slow, args=(30,)) for _ in range(3)]
            pid = rpc.rpc_sync("worker1", getpid)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            errors = []
            for fut in pending:
                try:
                    fut.wait()
                    errors.append(None)
                except RuntimeError as e:
                    errors.append(str(e))
            out["detect_s"] = time.monotonic() - t0
            out["pending_errors"] = errors
            t0 = time.monotonic()
            try:
                rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
            except RuntimeError as e:
                out["new_call_error"] = str(e)
            out["new_call_s"] = time.monotonic() - t0
            out["survivor"] = rpc.rpc_sync("worker2", torch.add, args=(torch.ones(1), 41)).item()
            # A dial that failed is counted where its connection's close
            # runs, on the loop, which the error to the caller can precede.
            deadline = time.monotonic() + 10
            while True:
                metrics = rpc.api._get_current_rpc_agent().get_metrics()
                if int(metrics["rpc_ext.peer.worker1.dial_failures"]) > 0 or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            out["errors_metric"] = int(metrics["rpc_ext.peer.worker1.errors"])
            out["events_1"] = {k: int(metrics[f"rpc_ext.peer.worker1.{k}"]) for k in (
                "dials", "reconnects", "dial_failures", "accepted", "connections_lost",
                "in_flight")}
            out["accepted_2"] = int(metrics["rpc_ext.peer.worker2.accepted"])
        finally:
            done_with_2.set()  # worker2 may leave now (also if the above failed)
    if rank == 1:
        time.sleep(60)  # serve until worker0 SIGKILLs us
    if rank == 2:
        # Stay up until worker0 is done with us, then leave with it.
        out["from_0"] = rpc.rpc_sync("worker0", torch.add, args=(torch.ones(1), 1)).item()
        done_with_2.wait(60)
    rpc.shutdown(graceful=False)
    return out


def test_sigkilled_peer_fails_pending_calls_promptly_and_survivors_continue():
    out = run_world(scenario, world_size=3, dies=frozenset({1}), timeout=90,
                    done_with_2=mp.get_context("fork").Event())[0]
    # From the SIGKILL to the last pending call failed; rpc_timeout is 60 s.
    assert out["detect_s"] < 5, out["detect_s"]
    for err in out["pending_errors"]:
        assert err is not None and "worker1" in err
        assert "lost" in err or "closed" in err
    assert "worker1" in out["new_call_error"]
    assert out["new_call_s"] < 5
    assert out["survivor"] == 42.0
    assert out["errors_metric"] >= 3
    # Connection events (torch_rpc_ext_connections_total and the rest): the
    # connection to worker1 was ready, then lost; the new call dialled again
    # (a reconnect) and that dial failed; nothing is left in flight.
    events = out["events_1"]
    assert events["dials"] >= 2 and events["reconnects"] >= 1, events
    assert events["connections_lost"] >= 1 and events["dial_failures"] >= 1, events
    assert events["in_flight"] == 0, events
    assert out["accepted_2"] >= 1  # worker2 called us


def frozen(rank, world_size, keep_sending=False, **options):
    # A frozen (SIGSTOPped) peer keeps its sockets open: only the heartbeat
    # can tell it from a slow one.
    init(rank, world_size, rpc_timeout=60, heartbeat_timeout=2, **options)
    out = {}
    if rank == 0:
        pending = [rpc.rpc_async("worker1", slow, args=(30,)) for _ in range(2)]
        # Asked before the pid: worker1's last sign of life comes after this.
        asked = time.monotonic()
        pid = rpc.rpc_sync("worker1", getpid)
        frozen_at = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        sending = None
        if keep_sending:
            # A call every 0.25 s, which the peer's buffers take for long
            # (its 64 KiB frame ring: about a minute of them): before
            # session 96 each counted as the peer's sign of life, and the
            # heartbeat never fired. (Their own failures are not the test's.)
            def sender():
                while not all(f.done() for f in pending):
                    rpc.rpc_async("worker1", getpid)
                    time.sleep(0.25)

            sending = threading.Thread(target=sender, daemon=True)
            sending.start()
        out["errors"] = []
        for fut in pending:
            try:
                fut.wait()
                out["errors"].append(None)
            except RuntimeError as e:
                out["errors"].append(str(e))
        now = time.monotonic()
        if sending is not None:
            sending.join(10)  # before shutdown: it stops once both failed
        out["since_asked_s"], out["since_frozen_s"] = now - asked, now - frozen_at
        metrics = rpc.api._get_current_rpc_agent().get_metrics()
        out["heartbeat_timeouts"] = sum(
            int(v) for k, v in metrics.items() if k.endswith(".heartbeat_timeouts"))
        os.kill(pid, signal.SIGKILL)
    else:
        time.sleep(60)
    rpc.shutdown(graceful=False)
    return out


@pytest.mark.parametrize(
    "keep_sending, transport",
    [(False, "shm"), (True, "shm"), (True, "tls")],
    ids=["False", "True", "tls-sending"],
)
def test_frozen_peer_is_detected_by_the_heartbeat(keep_sending, transport):
    # Over TLS our sends count as the peer's sign of life only where records
    # were left pending (the socket full): before session 96's review, each
    # TLS send counted, and a caller sending every 0.25 s kept a frozen peer
    # alive for as long as its socket buffers took them.
    options = {"transports": ["tcp"], "encryption": "always"} if transport == "tls" else {}
    out = run_world(frozen, dies=frozenset({1}), timeout=60, keep_sending=keep_sending, **options)[0]
    # Declared dead once silent for heartbeat_timeout (2 s): not before 2 s
    # from asking for the pid (the answer, a sign of life, came later). On a
    # quiet host 2-2.4 s after the freeze; a starved process or a busy host
    # gives the peer more time, up to 6 timeouts in all (connection.cpp,
    # kMaxHandshakeTimeouts), and that cap is what is checked against:
    # rpc_timeout is 60 s.
    assert out["since_asked_s"] >= 2.0, out
    assert out["since_frozen_s"] < 6 * 2 + 3, out
    for err in out["errors"]:
        assert err is not None and "worker1" in err and "heartbeat" in err, err
    assert out["heartbeat_timeouts"] >= 1  # torch_rpc_ext_heartbeat_timeouts_total


def echo(x):
    return x


def rref_forks():
    info = torch._C._distributed_rpc._rref_context_get_debug_info()
    return int(info["num_forks"]), int(info["num_owner_rrefs"])


def queued_behind_a_frozen_peer(rank, world_size):
    # Over TCP, the stream alone: a 64 MiB request to a frozen peer fills
    # the sockets' buffers, and a request carrying an RRef of ours waits
    # queued behind it until the heartbeat closes the connection. It never
    # left: its fork must go (before session 100 it was kept, and a graceful
    # shutdown waited 100 s for it: "Leaking RRef").
    init(rank, world_size, rpc_timeout=60, heartbeat_timeout=2, transports=["tcp"], channels=())
    out = {}
    if rank == 0:
        pid = rpc.rpc_sync("worker1", getpid)
        os.kill(pid, signal.SIGSTOP)
        big = rpc.rpc_async("worker1", echo, args=(torch.zeros(16 * 2**20),))
        mine = rpc.RRef(torch.ones(1))
        queued = rpc.rpc_async("worker1", echo, args=(mine,))
        out["forks_queued"] = rref_forks()
        out["errors"] = []
        for fut in (big, queued):
            try:
                fut.wait()
                out["errors"].append(None)
            except RuntimeError as e:
                out["errors"].append(str(e))
        # (Dropped off the transport's thread once the connection closed.)
        deadline = time.monotonic() + 30
        while rref_forks() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        out["forks_left"] = rref_forks()
        os.kill(pid, signal.SIGKILL)
    else:
        time.sleep(60)
    rpc.shutdown(graceful=False)
    return out


def test_a_request_queued_when_its_connection_closed_drops_its_forks():
    out = run_world(queued_behind_a_frozen_peer, dies=frozenset({1}), timeout=90)[0]
    assert out["forks_queued"] == (1, 1), out
    for err in out["errors"]:
        assert err is not None and "worker1" in err and "heartbeat" in err, err
    assert out["forks_left"] == (0, 0), out


def freeze_then_answer_big(pid):
    os.kill(pid, signal.SIGSTOP)  # the caller, which will read nothing more
    return torch.zeros(16 * 2**20)


def answer_an_rref_of_ours():
    # Once the big answer is queued (counted as sent as it is queued), so
    # that this one waits behind it, unwritten.
    agent = rpc.api._get_current_rpc_agent()
    deadline = time.monotonic() + 30
    while int(agent.get_metrics()["rpc_ext.peer.worker0.bytes_sent"]) < 16 * 2**22:
        assert time.monotonic() < deadline, "the big answer was never queued"
        time.sleep(0.02)
    return rpc.RRef(torch.ones(1))


def answered_to_a_frozen_peer(rank, world_size, pid0):
    # The answers' way: an answer carrying an RRef of the callee's, queued
    # behind a 64 MiB one when the heartbeat closes the connection to its
    # frozen caller, never left: the callee drops the fork it made for it.
    init(rank, world_size, rpc_timeout=60, heartbeat_timeout=2, transports=["tcp"], channels=())
    out = {}
    if rank == 0:
        pid0.value = os.getpid()
        # (In this order: the first waits for the second's answer to be
        # queued, and the second stops us.)
        rpc.rpc_async("worker1", answer_an_rref_of_ours)
        rpc.rpc_async("worker1", freeze_then_answer_big, args=(os.getpid(),))
        time.sleep(60)  # (frozen meanwhile, then killed)
    else:
        deadline = time.monotonic() + 30
        while rref_forks() == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        out["forks_answered"] = rref_forks()
        deadline = time.monotonic() + 30
        while rref_forks() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        out["forks_left"] = rref_forks()
        metrics = rpc.api._get_current_rpc_agent().get_metrics()
        out["heartbeat_timeouts"] = sum(int(v) for k, v in metrics.items() if k.endswith(".heartbeat_timeouts"))
        os.kill(pid0.value, signal.SIGKILL)
    rpc.shutdown(graceful=False)
    return out


def test_an_answer_queued_when_its_connection_closed_drops_its_forks():
    pid0 = mp.get_context("fork").Value("i", 0)
    out = run_world(answered_to_a_frozen_peer, dies=frozenset({0}), timeout=90, pid0=pid0)[1]
    assert out["forks_answered"] == (1, 1), out
    assert out["forks_left"] == (0, 0), out
    assert out["heartbeat_timeouts"] >= 1, out


def stretched_frame(rank, world_size):
    # A frame through the shm_ring channel that takes many heartbeat
    # timeouts, its receiver alive but held off its CPU most of the time
    # (stopped 0.4 s, continued 0.02 s), now that our own sends count as the
    # peer's sign of life only where they had found no room. (A guard: it
    # passed here with and without the pings a receiver sends while a frame
    # is partly in, the stream's frame ring filling meanwhile; the pings
    # cover channels whose records never fill a buffer.)
    init(rank, world_size, heartbeat_timeout=1, rpc_timeout=120, channels=["shm_ring"])
    out = {}
    if rank == 0:
        pid = rpc.rpc_sync("worker1", getpid)
        stop = threading.Event()

        def throttle():
            while not stop.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.4)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.02)

        x = torch.ones(48 << 20)  # 192 MB: 24 fills of the largest ring
        throttling = threading.Thread(target=throttle, daemon=True)
        t0 = time.monotonic()
        throttling.start()
        try:
            out["result"] = rpc.rpc_sync("worker1", torch.numel, args=(x,))
        except RuntimeError as e:
            out["result"] = str(e)
        finally:
            stop.set()
            throttling.join(10)
            os.kill(pid, signal.SIGCONT)
        out["seconds"] = time.monotonic() - t0
    rpc.shutdown()
    return out


def test_a_frame_longer_than_the_heartbeat_timeout_keeps_its_connection():
    out = run_world(stretched_frame, timeout=150)[0]
    # (It takes a few heartbeat timeouts: 3 to 11 s here, in "seconds".)
    assert out["result"] == 48 << 20, out


def _gone(pid):
    """Whether a process (not our child) has exited: a zombie has closed its
    files and sockets already."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def shutdown_with_a_dead_peer(rank, world_size, pid1, all_up, two_done):
    if rank == 1:
        pid1.value = os.getpid()
    init(rank, world_size, rpc_timeout=5)
    all_up.wait(60)  # every init_rpc has returned
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not _gone(pid1.value):  # worker1 is gone before shutdown starts
        assert time.monotonic() < deadline, "worker1 did not die"
        time.sleep(0.01)
    t0 = time.monotonic()
    err = None
    try:
        rpc.shutdown(graceful=True, timeout=5)
    except RuntimeError as e:
        err = str(e)
    elapsed = time.monotonic() - t0
    if rank == 2:
        two_done.set()
    else:
        two_done.wait(60)  # we host the store: stay until worker2 is done with it
    return {"seconds": elapsed, "error": err}


def test_graceful_shutdown_with_a_dead_peer_raises_within_its_timeout():
    ctx = mp.get_context("fork")
    out = run_world(shutdown_with_a_dead_peer, world_size=3, dies=frozenset({1}), timeout=90,
                    pid1=ctx.Value("i", 0), all_up=ctx.Barrier(3), two_done=ctx.Event())
    for rank in (0, 2):
        # Raises, naming the dead worker, instead of waiting for it forever.
        assert out[rank]["seconds"] < 15, out
        assert out[rank]["error"] is not None and "worker1" in out[rank]["error"], out


# rpc.shutdown() with its default timeout (0): upstream's gather waits for its
# signal without a limit, on TensorPipe too. Ours watches the workers it waits
# on (_torch_private.watched_wait_all_workers) and ends it naming the one gone.

def leader_waits_for_a_dead_follower(rank, world_size, pid1, all_up):
    if rank == 1:
        pid1.value = os.getpid()
    init(rank, world_size, rpc_timeout=5)
    all_up.wait(60)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not _gone(pid1.value):
        assert time.monotonic() < deadline, "worker1 did not die"
        time.sleep(0.01)
    t0 = time.monotonic()
    try:
        rpc.shutdown()  # graceful, no timeout: the leader waits for worker1
        err = None
    except RuntimeError as e:
        err = str(e)
    return {"seconds": time.monotonic() - t0, "error": err}


def test_a_graceful_shutdown_without_a_timeout_ends_when_a_follower_is_dead():
    ctx = mp.get_context("fork")
    out = run_world(leader_waits_for_a_dead_follower, world_size=2, dies=frozenset({1}),
                    timeout=90, pid1=ctx.Value("i", 0), all_up=ctx.Barrier(2))[0]
    # Without the watch it waits forever (the world's timeout kills it).
    assert out["error"] is not None and "cannot reach worker1" in out["error"], out
    assert out["seconds"] < 15, out


def follower_waits_for_a_dead_leader(rank, world_size, store_file, all_up):
    init(rank, world_size, rpc_timeout=5, init_method=f"file://{store_file}")
    all_up.wait(60)
    if rank == 0:
        # worker0 is the gather's leader, and never shuts down: it dies once
        # it holds worker1's gather (served by its agent), before it could
        # broadcast.
        from torch.distributed.rpc import api

        deadline = time.monotonic() + 60
        while not any("worker1" in st.gathered_objects
                      for st in list(api._all_gather_sequence_id_to_states.values())):
            assert time.monotonic() < deadline, "worker1's gather never came"
            time.sleep(0.01)
        time.sleep(0.5)  # its reply on its way: worker1 then waits for the broadcast
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        rpc.shutdown()
        err = None
    except RuntimeError as e:
        err = str(e)
    return {"seconds": time.monotonic() - t0, "error": err}


def test_a_graceful_shutdown_without_a_timeout_ends_when_the_leader_is_dead(tmp_path):
    ctx = mp.get_context("fork")
    out = run_world(follower_waits_for_a_dead_leader, world_size=2, dies=frozenset({0}),
                    timeout=90, store_file=str(tmp_path / "store"),
                    all_up=ctx.Barrier(2))[1]
    # Named by the watch, or, on a host so loaded that worker0 died before
    # its reply to the gather went out, by that call's own failure.
    assert out["error"] is not None and "worker0" in out["error"], out
    assert out["seconds"] < 15, out


def watched_without_a_connection(rank, world_size, all_up, opts):
    init(rank, world_size, **opts)
    all_up.wait(60)
    out = None
    if rank == 1:
        # The leader (worker0) never calls worker1 and waits for it in its
        # shutdown, watching it each second; worker1 comes once it has been
        # knocked on twice (or connected to: what the watch did before).
        agent = rpc.api._get_current_rpc_agent()
        deadline = time.monotonic() + 60
        while (int((m := agent.get_metrics())["rpc_ext.knocks"]) < 2
               and int(m["rpc_ext.peer.worker0.accepted"]) == 0):
            assert time.monotonic() < deadline, "the leader's watch never probed"
            time.sleep(0.05)
        metrics = agent.get_metrics()
        out = {"accepted_from_worker0": int(metrics["rpc_ext.peer.worker0.accepted"]),
               "rejected_connections": int(metrics["rpc_ext.rejected_connections"])}
    rpc.shutdown()
    return out


@pytest.mark.parametrize("opts", [{}, {"transports": ("tcp",), "encryption": "always"}],
                         ids=["shm", "tcp_tls"])
def test_the_shutdown_watch_opens_no_connection_to_a_worker_it_never_called(opts):
    # Knocked on (a connect and a close), not dialled: a full connection,
    # frame rings and channels, made a second into the leader's shutdown, in
    # the middle of whatever the group still did (session 50 found one in a
    # benchmark's measured window). Nor is the knock taken for a refused
    # peer at the listener's end.
    out = run_world(watched_without_a_connection, world_size=2, timeout=90,
                    all_up=mp.get_context("fork").Barrier(2), opts=opts)[1]
    assert out == {"accepted_from_worker0": 0, "rejected_connections": 0}, out


def knocked_on_together(rank, world_size, pid2, all_up, done, opts):
    if rank == 2:
        pid2.value = os.getpid()
    init(rank, world_size, **opts)
    all_up.wait(60)
    out = None
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    elif rank == 0:
        deadline = time.monotonic() + 60
        while not _gone(pid2.value):
            assert time.monotonic() < deadline, "worker2 did not die"
            time.sleep(0.01)
        # Never called either: both knocked on at once, one alive, one gone.
        # (A killed process's leader thread is a zombie before its last
        # thread has closed the files they share: its listener may answer a
        # moment longer.)
        agent = rpc.api._get_current_rpc_agent()
        deadline = time.monotonic() + 30
        while True:
            why = agent._why_unreachable(["worker1", "worker2"], 250, dial=False)
            if why[1] or time.monotonic() > deadline or why[0]:
                break
            time.sleep(0.05)
        out = {"why": why}
        done.set()
    else:
        done.wait(60)
        # The knock is over for worker0 once the kernel accepted it; this
        # end counts it when its loop reads the close.
        agent = rpc.api._get_current_rpc_agent()
        deadline = time.monotonic() + 30
        while (int((m := agent.get_metrics())["rpc_ext.knocks"]) == 0
               and int(m["rpc_ext.peer.worker0.accepted"]) == 0
               and time.monotonic() < deadline):
            time.sleep(0.02)
        out = {"accepted": int(m["rpc_ext.peer.worker0.accepted"]),
               "knocked": int(m["rpc_ext.knocks"]) >= 1}
    rpc.shutdown(graceful=False)
    return out


@pytest.mark.parametrize("opts", [{}, {"transports": ("tcp",), "encryption": "always"}],
                         ids=["shm", "tcp_tls"])
def test_knocks_tell_a_live_worker_from_a_dead_one_without_a_connection(opts):
    ctx = mp.get_context("fork")
    out = run_world(knocked_on_together, world_size=3, dies=frozenset({2}), timeout=90,
                    pid2=ctx.Value("i", 0), all_up=ctx.Barrier(3), done=ctx.Event(),
                    opts=opts)
    alive, dead = out[0]["why"]
    assert alive == "", out
    # The kernel's answer for a port nobody holds: refused, or reset where
    # the knock's connection reached the dead worker's listener in the
    # instant its last thread was closing it (a CI run of session 91).
    # Either is the dead process's answer, never a timeout.
    assert "Connection refused" in dead or "Connection reset by peer" in dead, out
    assert out[1] == {"accepted": 0, "knocked": True}, out


def redials_a_dead_peer(rank, world_size, tries):
    # Over TCP, whose connect is answered on the loop, after the call is
    # queued on it (a refused local socket fails the call's write at once).
    init(rank, world_size, rpc_timeout=20, transports=["tcp"])
    out = {}
    if rank == 0:
        pid = rpc.rpc_sync("worker1", getpid)
        os.kill(pid, signal.SIGKILL)
        out["errors"] = []
        for _ in range(tries):  # a caller's retry loop
            try:
                rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
            except RuntimeError as e:
                out["errors"].append(str(e))
        metrics = rpc.api._get_current_rpc_agent().get_metrics()
        out["dials"] = int(metrics["rpc_ext.peer.worker1.dials"])
    if rank == 1:
        time.sleep(60)  # serve until worker0 SIGKILLs us
    rpc.shutdown(graceful=False)
    return out


def test_a_caller_retrying_a_dead_peer_logs_its_failed_dials_once_per_10_s(capfd):
    """Each call to a peer that is gone dials it again, and each failed dial
    failed a call: the warning ("lost connection ... with 1 calls pending")
    came once per try, so a retry loop wrote a line per try (16 of 20
    here before). Now one line per 10 s; each call's error still says
    why."""
    tries = 20
    out = run_world(redials_a_dead_peer, world_size=2, dies=frozenset({1}), timeout=90,
                    tries=tries)[0]
    assert len(out["errors"]) == tries, out
    assert all("worker1" in e for e in out["errors"]), out["errors"]
    assert out["dials"] >= tries // 2, out  # the calls did dial
    lost = [line for line in capfd.readouterr().err.splitlines() if "lost connection" in line]
    assert 1 <= len(lost) <= 2, lost
