# SPDX-License-Identifier: BSD-3-Clause
"""Ends (ipc_worker.End) whose peer goes away while the connection is still
held: what the channels mapped, pinned or imported for it must go when the
connection closes, not when the last hold on it does (a request still
served for that peer holds it as long as it runs; the Endpoint's hold on
its connection stands for one here). Each scenario's receiver reports its
process's counts before the connection, while it is up, and after it
closed."""

import faulthandler
import os
import signal
import time

from tests.cuda_driver.ipc_worker import CUDA, DEVICE, TIMEOUT, WATCHDOG_S, End, pattern
from tests.cuda_driver.worker import fake_stats


def run(role: str, conn, ctl, scenario: str) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    globals()[f"{scenario}_{role}"](conn, ctl)


def ring_counts() -> tuple[int, int]:
    """(shared-memory slabs mapped here: a cuda_ring's memory is one, host
    ranges registered with the driver: a ring pinned for copies)."""
    with open("/proc/self/maps") as f:
        mapped = sum("memfd:torch_rpc_ext-slab" in line for line in f)
    return mapped, fake_stats()["live"]["host_registered"]


def settled_counts(count, baseline, timeout=10.0):
    """`count()` once it is back to `baseline`, or as it is after `timeout`
    (the last holder of a ring frees it on the staging thread)."""
    deadline = time.monotonic() + timeout
    while (now := count()) != baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


# ---- ring_closed: a peer that exits with both cuda_rings set up -------------

RING_BYTES = 4 << 20
RING = ("cuda_ring", "cuda_staged")


def ring_closed_sender(conn, ctl):
    end = End("sender", conn, channels=RING)
    p = end.alloc(pattern(RING_BYTES, 1))
    end.send_device(b"there", p, RING_BYTES)
    head, (region,) = end.receive()
    ok = head == b"back" and end.read_region(region) == pattern(RING_BYTES, 2)
    ctl.send((ok, end.counters("cuda_ring")))
    os._exit(0)  # gone at once: no close, no drop of its ring


def ring_closed_receiver(conn, ctl):
    baseline = ring_counts()
    end = End("receiver", conn, channels=RING)
    head, (region,) = end.receive()
    ok = head == b"there" and end.read_region(region) == pattern(RING_BYTES, 1)
    region.release()
    q = end.alloc(pattern(RING_BYTES, 2))
    end.ep.send(b"back", [(q, RING_BYTES, CUDA, DEVICE, end.stream)], [])
    during = ring_counts()  # the peer's ring and ours
    deadline = time.monotonic() + TIMEOUT
    while not end.ep.close_reason() and time.monotonic() < deadline:
        time.sleep(0.01)
    reason = end.ep.close_reason()
    after = settled_counts(ring_counts, baseline)
    ctl.send((ok, baseline, during, after, reason, end.counters("cuda_ring")))
    end.close()


# ---- ipc_closed: a peer that exits with cuda_ipc blocks both ways -----------

IPC_BYTES = 3 << 20
IPC_KEYS = ("allocations", "vmm_mappings", "ipc_mem_mappings", "opened_ipc_events")


def ipc_counts() -> tuple[int, ...]:
    """Device memory made here, and the peer's imported (mapped, opened)."""
    live = fake_stats()["live"]
    return tuple(live[k] for k in IPC_KEYS)


def ipc_closed_sender(conn, ctl):
    end = End("sender", conn)
    p = end.alloc(pattern(IPC_BYTES, 1))
    end.send_device(b"there", p, IPC_BYTES)
    head, (region,) = end.receive()
    ok = head == b"back" and end.read_region(region) == pattern(IPC_BYTES, 2)
    ctl.send((ok, end.counters()))
    os._exit(0)  # gone at once, holding the receiver's block


def ipc_closed_receiver(conn, ctl):
    baseline = ipc_counts()
    end = End("receiver", conn)
    q = end.alloc(pattern(IPC_BYTES, 2))
    head, (region,) = end.receive()
    ok = head == b"there" and end.read_region(region) == pattern(IPC_BYTES, 1)
    region.release()
    end.send_device(b"back", q, IPC_BYTES)  # lent to the peer in a block of ours
    during = ipc_counts()
    deadline = time.monotonic() + TIMEOUT
    while not end.ep.close_reason() and time.monotonic() < deadline:
        time.sleep(0.01)
    reason = end.ep.close_reason()
    end.cu.stream_synchronize(DEVICE, end.stream)
    end.live.remove(q)
    end.cu.mem_free(DEVICE, q)  # ours, not the channel's
    # A block lent to the peer is kept until the channel's deadline (2 s)
    # for the peer's events, which it may still hold open if it lives.
    after = settled_counts(ipc_counts, baseline)
    ctl.send((ok, baseline, during, after, reason, end.counters()))
    end.close()


# ---- legacy_late: a peer that dies before its copy into a legacy block ran --

LATE_BYTES = 1 << 20
LATE_DELAY_MS = 600_000  # the sender's copy in never runs: it dies first
LATE_WAIT_S = 4.0  # twice the channel's deadline for a legacy block's waits


def legacy_late_sender(conn, ctl):
    from tests.cuda_driver.worker import set_fake_kernel_delay

    end = End("sender", conn)
    p = end.alloc(pattern(LATE_BYTES, 3))
    set_fake_kernel_delay(LATE_DELAY_MS)  # its copy into the block, and `ready`
    end.send_device(b"late", p, LATE_BYTES)
    head, _ = end.receive()  # the receiver has queued its copy out
    ctl.send((head == b"got", end.counters()))
    os._exit(0)  # gone with `ready` recorded, never completed


def legacy_late_receiver(conn, ctl):
    baseline = ipc_counts()
    end = End("receiver", conn)
    head, (region,) = end.receive()
    ok = head == b"late"
    end.ep.send(b"got", [])
    during = ipc_counts()  # the peer's legacy block mapped, its events opened
    deadline = time.monotonic() + TIMEOUT
    while not end.ep.close_reason() and time.monotonic() < deadline:
        time.sleep(0.01)
    reason = end.ep.close_reason()
    end.ep.close(0.0)  # nothing holds the connection now
    # Our copy out of the peer's block waits on `ready` for ever: its
    # mapping must stay past the channel's deadline, not be closed under it.
    time.sleep(LATE_WAIT_S)
    after = ipc_counts()
    # Its landing (a block of the device's pool, ready never) goes back;
    # the next landing of that size, from anyone, must not wait behind it.
    region.release()
    landed = staged_landing_completes(end.cu, LATE_BYTES)
    ctl.send((ok, baseline, during, after, reason, landed, end.counters()))
    os._exit(0)  # (our copy-out stream waits for ever)


def staged_landing_completes(cu, n, timeout=10.0):
    """Whether a segment of `n` bytes sent by cuda_staged between two
    endpoints of this process lands, intact, within `timeout` s (its landing
    is a block of the device's pool, as a legacy copy out's is)."""
    import threading

    from tests.cuda_driver.ipc_worker import SECRET
    from torch_rpc_ext import _testing

    a = _testing.Endpoint(0, 2, SECRET, "shm", ["cuda_staged"])
    b = _testing.Endpoint(1, 2, SECRET, "shm", ["cuda_staged"])
    a.set_peer(b.descriptors())
    b.set_peer(a.descriptors())
    a.connect(b.address, 1)
    assert a.wait_ready(TIMEOUT), a.close_reason()
    p = cu.mem_alloc(DEVICE, n)
    cu.write(DEVICE, p, pattern(n, 4))
    stream = cu.stream_create(DEVICE)
    a.send(b"after", [(p, n, CUDA, DEVICE, stream)], [None])
    got = b.receive(TIMEOUT)
    assert got is not None, b.close_reason()
    head, (region,) = got
    region.wait_on(stream)
    done = threading.Event()
    threading.Thread(
        target=lambda: (cu.stream_synchronize(DEVICE, stream), done.set()), daemon=True).start()
    return head == b"after" and done.wait(timeout) and cu.read(DEVICE, region.address, n) == pattern(n, 4)


# ---- legacy_slow, legacy_gone: a peer still copying out of our legacy block
# when the connection closes, alive (slow) or killed ------------------------

SLOW_BYTES = 1 << 20
SLOW_COPY_MS = 6_000  # the receiver's copy out of the block runs this late
SLOW_HELD_S = 3.5  # past the channel's 2 s deadline, before that copy ran


def legacy_slow_sender(conn, ctl, peer_lives=True):
    baseline = ipc_counts()
    end = End("sender", conn)
    p = end.alloc(pattern(SLOW_BYTES, 5))
    end.send_device(b"slow", p, SLOW_BYTES)
    head, _ = end.receive()  # the receiver's copy out is queued, and late
    end.cu.stream_synchronize(DEVICE, end.stream)
    end.live.remove(p)
    end.cu.mem_free(DEVICE, p)  # ours, not the channel's: the block stays
    with_block = ipc_counts()
    closed = time.monotonic()
    end.ep.close(0.0)  # nothing holds the connection now
    time.sleep(SLOW_HELD_S)
    held = ipc_counts()
    after = settled_counts(ipc_counts, baseline, timeout=20.0)
    freed_in = time.monotonic() - closed
    # Alive until the receiver's import closed (a close after ours freed
    # the memory counts as a poisoned use there only while we live).
    if peer_lives:
        conn.recv()
    ctl.send((head == b"got", baseline, with_block, held, after, freed_in))
    os._exit(0)


def legacy_gone_sender(conn, ctl):
    legacy_slow_sender(conn, ctl, peer_lives=False)


def legacy_slow_receiver(conn, ctl, die=False):
    from tests.cuda_driver.worker import set_fake_kernel_delay

    mappings = ipc_counts()[IPC_KEYS.index("ipc_mem_mappings")]
    end = End("receiver", conn)
    set_fake_kernel_delay(SLOW_COPY_MS)  # our copy out of the peer's block
    head, (region,) = end.receive()
    end.ep.send(b"got", [])
    if die:
        ctl.send((head == b"slow", end.counters()))
        os._exit(0)  # gone with the copy out, and `released`, pending
    deadline = time.monotonic() + TIMEOUT
    while not end.ep.close_reason() and time.monotonic() < deadline:
        time.sleep(0.01)
    reason = end.ep.close_reason()
    intact = end.read_region(region) == pattern(SLOW_BYTES, 5)  # once it ran
    set_fake_kernel_delay(0)
    region.release()
    # Our import of the peer's block closes once our copy out of it ran.
    unmapped = settled_counts(lambda: ipc_counts()[IPC_KEYS.index("ipc_mem_mappings")],
                              mappings, timeout=20.0) == mappings
    ctl.send((head == b"slow", intact, reason, unmapped, poisoned_uses(), end.counters()))
    conn.send("done")
    os._exit(0)


def legacy_gone_receiver(conn, ctl):
    legacy_slow_receiver(conn, ctl, die=True)


def poisoned_uses() -> int:
    """Uses of IPC memory or events after their exporter let them go."""
    return fake_stats()["poisoned_uses"]


# ---- legacy_unread: the peer, stopped, reads the frame only after our close --


def legacy_unread_sender(conn, ctl):
    baseline = ipc_counts()
    end = End("sender", conn)
    peer = conn.recv()
    p = end.alloc(pattern(SLOW_BYTES, 6))
    os.kill(peer, signal.SIGSTOP)  # it reads nothing until SIGCONT
    end.send_device(b"unread", p, SLOW_BYTES)
    end.cu.stream_synchronize(DEVICE, end.stream)
    end.live.remove(p)
    end.cu.mem_free(DEVICE, p)  # ours, not the channel's: the block stays
    with_block = ipc_counts()
    closed = time.monotonic()
    end.ep.close(5.0)  # once the frame is written (the socket takes it)
    time.sleep(SLOW_HELD_S)
    held = ipc_counts()
    os.kill(peer, signal.SIGCONT)
    copied = conn.recv()  # it read the frame, and copied it out (or failed)
    after = settled_counts(ipc_counts, baseline, timeout=40.0)
    ctl.send((copied, baseline, with_block, held, after, time.monotonic() - closed))
    os._exit(0)


def legacy_unread_receiver(conn, ctl):
    mappings = ipc_counts()[IPC_KEYS.index("ipc_mem_mappings")]
    end = End("receiver", conn)
    conn.send(os.getpid())
    got = end.ep.receive(TIMEOUT)  # once the sender's close let us run
    ok = got is not None and got[0] == b"unread"
    intact = ok and end.read_region(got[1][0]) == pattern(SLOW_BYTES, 6)
    if ok:
        got[1][0].release()
    conn.send(intact)
    unmapped = settled_counts(lambda: ipc_counts()[IPC_KEYS.index("ipc_mem_mappings")],
                              mappings, timeout=20.0) == mappings
    reason = end.ep.close_reason()
    ctl.send((ok, intact, reason, unmapped, poisoned_uses(), end.counters()))
    os._exit(0)


# ---- grant_held: a live peer's write into our grant, still queued at the close
#
# m0 earns a 3 MiB grant (plain driver memory: use_test_grants). The
# sender's next frame writes its first segment into it (the copy runs 6 s
# late) and is refused at send for its second (on a device the receiver
# does not have); the grant's return waits for that copy, and the sender
# closes at once, so it is never sent: the receiver holds the grant at its
# close while the live sender's write into it is still to run.


def grant_held_sender(conn, ctl):
    from tests.cuda_driver.ipc_worker import refused_after_a_grant, testing
    from tests.cuda_driver.worker import set_fake_kernel_delay

    os.environ["FAKE_CUDA_DEVICES"] = "2"
    testing().use_test_grants()
    end = End("sender", conn)
    # The copy into the grant runs late.
    error, _, _ = refused_after_a_grant(
        end, 3 << 20, before_send=lambda: set_fake_kernel_delay(SLOW_COPY_MS))
    end.ep.close()  # (the grant's event went first; its return never goes)
    closed = time.monotonic()
    closes = lambda: fake_stats()["calls"].get("cuIpcCloseMemHandle", 0)  # noqa: E731
    while closes() == 0 and time.monotonic() < closed + 30:
        time.sleep(0.05)
    unmapped_in = time.monotonic() - closed  # our mapping of its segment
    time.sleep(0.5)
    conn.send("unmapped")  # (the receiver lives until then)
    ctl.send((error, unmapped_in, poisoned_uses()))
    os._exit(0)


def grant_held_receiver(conn, ctl):
    from tests.cuda_driver.ipc_worker import testing

    os.environ["FAKE_CUDA_DEVICES"] = "1"
    testing().use_test_grants()
    grant_bytes = lambda: testing().test_grant_counts()["grant_bytes"]  # noqa: E731
    end = End("receiver", conn)
    head, (region,) = end.receive()
    ok = head == b"m0" and end.read_region(region) == pattern(3 << 20, 0)
    region.release()
    end.ep.send(b"ok0", [])
    deadline = time.monotonic() + TIMEOUT
    while not end.ep.close_reason() and time.monotonic() < deadline:
        time.sleep(0.01)
    reason = end.ep.close_reason()
    out = grant_bytes()  # the grant, held at the close
    time.sleep(SLOW_HELD_S)
    held = grant_bytes()
    conn.recv()  # the sender's copy ran, and its mapping closed
    after = settled_counts(grant_bytes, 0, timeout=20.0)
    # (Our queries of the sender's events all came before it destroyed them.)
    ctl.send((ok, reason, out, held, after, poisoned_uses(), end.counters()))
    os._exit(0)
