# SPDX-License-Identifier: BSD-3-Clause
"""The two ends of a cuda_ipc connection with no agent above it
(_testing.Endpoint over the shm transport), each in a spawned process that
loads the driver under test (worker.py says why not in pytest's).

Both ends run `run(role, conn, ctl, scenario)`: they trade addresses and
channel descriptors on `conn`, connect, and play the scenario; each sends
what it saw on `ctl`, its pipe to the test. Frames are ordered on the
connection, so a reply frame arrives after every control frame its sender
queued before it (a block's release, say)."""

import faulthandler
import os
import signal
import time

from tests.cuda_driver.worker import (
    DEVICE,
    fake_stats,
    kernel_images,
    set_fake_kernel_delay,
    testing,
)

SECRET = b"s" * 32
CUDA = 1  # c10::DeviceType::CUDA
TIMEOUT = 60.0


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


class End:
    def __init__(self, role: str, conn, channels=("cuda_ipc",), offer=True, transport="shm",
                 early=None):
        from torch_rpc_ext import _C, _testing

        _C._set_cuda_kernel_images(kernel_images())
        self.cu = testing()
        self.role = role
        self.conn = conn
        me = 0 if role == "sender" else 1
        self.ep = _testing.Endpoint(me, 2, SECRET, transport, list(channels))
        conn.send((self.ep.address, self.ep.descriptors() if offer else {}))
        address, peer = conn.recv()
        self.ep.set_peer(peer)
        # Both ends know each other's descriptors before either connects.
        conn.send("ready")
        assert conn.recv() == "ready"
        self.stream = self.cu.stream_create(DEVICE)
        self.live = []
        if role == "sender":
            self.ep.connect(address, 1)
            if early is not None:
                early(self)  # before the connection is ready
        assert self.ep.wait_ready(TIMEOUT), self.ep.close_reason()

    def alloc(self, data: bytes) -> int:
        p = self.cu.mem_alloc(DEVICE, len(data))
        self.live.append(p)
        self.cu.write(DEVICE, p, data)
        return p

    def send_device(self, head: bytes, p: int, n: int, hand_back=None):
        self.ep.send(head, [(p, n, CUDA, DEVICE, self.stream)], [hand_back])

    def receive(self):
        got = self.ep.receive(TIMEOUT)
        assert got is not None, f"{self.role}: nothing arrived ({self.ep.close_reason()})"
        return got

    def read_region(self, region) -> bytes:
        region.wait_on(self.stream)
        self.cu.stream_synchronize(DEVICE, self.stream)
        return self.cu.read(DEVICE, region.address, region.size)

    def counters(self, channel: str = "cuda_ipc") -> dict[str, int]:
        return dict(self.ep.counters()[channel])

    def close(self):
        self.cu.stream_synchronize(DEVICE, self.stream)
        self.ep.close()
        for p in self.live:
            self.cu.mem_free(DEVICE, p)


# An end still running after this many seconds is taken as hung: it prints
# every thread's Python stack to stderr and exits 1 (the test's play() waits
# 120 s for a report). SIGUSR1 prints them too (play() sends it to an end
# left running when the test gives up on it).
WATCHDOG_S = 110


def run(role: str, conn, ctl, scenario: str) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    globals()[f"{scenario}_{role}"](conn, ctl)


# ---- pooled: four messages in two blocks, released in between ---------------

# Two of each: a large segment and a large one that fits its block, a small
# one (too small to tie up the large block: a block of its own) and a tiny
# one that fits that.
SIZES = (3 << 20, (3 << 20) - 5, 5000, 1)


def pooled_sender(conn, ctl):
    end = End("sender", conn)
    for i, n in enumerate(SIZES):
        p = end.alloc(pattern(n, i))
        end.send_device(b"m%d" % i, p, n)
        head, _ = end.receive()  # the receiver's reply: its release came first
        assert head == b"ok%d" % i
    ctl.send(end.counters())
    end.close()


def pooled_receiver(conn, ctl):
    end = End("receiver", conn)
    seen = []
    for i, n in enumerate(SIZES):
        head, (region,) = end.receive()
        seen.append((head, region.size, region.device, end.read_region(region) == pattern(n, i)))
        region.release()
        end.ep.send(b"ok%d" % i, [])
    ctl.send((seen, end.counters()))
    end.close()


# ---- outlives: the view stays valid after the sender frees, closes, exits --


def outlives_sender(conn, ctl):
    end = End("sender", conn)
    p = end.alloc(pattern(1 << 20, 3))
    end.send_device(b"x", p, 1 << 20)
    end.receive()  # the receiver has the region
    end.close()  # frees its memory and its side of the block, then exits
    ctl.send("closed")


def outlives_receiver(conn, ctl):
    end = End("receiver", conn)
    head, (region,) = end.receive()
    end.ep.send(b"got", [])
    assert ctl.recv() == "exited"  # the test saw the sender's process end
    data = end.read_region(region)
    # The sender's exit reaches our loop thread on its own schedule: wait
    # for the close (receive returns None once it is known) before asking.
    closed = end.ep.receive(TIMEOUT) is None and end.ep.close_reason()
    region.release()  # nobody to tell: a no-op, not a crash
    ctl.send((data == pattern(1 << 20, 3), closed))
    end.close()


# ---- closed_while_held: our block's events outlast a close the peer ----------
# ---- had no time to answer --------------------------------------------------
#
# The receiver holds the region (its import of the sender's block open) while
# the sender closes; the sender lives on a while (its teardown runs), then
# exits; only then does the receiver let go and close, destroying its opened
# copies of the block's events. The sender's own must not have been destroyed
# before (cuda.h: undefined; the fake counts it as a poisoned use).


def closed_while_held_sender(conn, ctl):
    end = End("sender", conn)
    end.send_device(b"x", end.alloc(pattern(64 << 10, 5)), 64 << 10)
    end.receive()  # the receiver has the region
    end.close()
    time.sleep(1.0)  # a teardown that does not wait has run by now
    ctl.send("closed")


def closed_while_held_receiver(conn, ctl):
    end = End("receiver", conn)
    head, (region,) = end.receive()
    end.ep.send(b"got", [])
    assert ctl.recv() == "exited"
    intact = end.read_region(region) == pattern(64 << 10, 5)
    region.release()
    end.close()
    time.sleep(0.2)  # its import retired (the staging thread)
    ctl.send((intact, poisoned()))


# ---- kept: a second segment while the first one's view is still held ------
#
# Under descriptors (kFd) the held view keeps its block lent, so the second
# segment needs another; a legacy block (kLegacy) was copied out and released
# on arrival, so the second reuses it, and the first view keeps its bytes.


def kept_sender(conn, ctl):
    end = End("sender", conn)
    n = 1 << 20
    for seed in (7, 8):
        end.send_device(b"k%d" % seed, end.alloc(pattern(n, seed)), n)
        end.receive()
    ctl.send(end.counters())
    end.close()


def kept_receiver(conn, ctl):
    end = End("receiver", conn)
    _, (first,) = end.receive()
    end.ep.send(b"got", [])
    _, (second,) = end.receive()
    intact = (end.read_region(first) == pattern(1 << 20, 7),
              end.read_region(second) == pattern(1 << 20, 8))
    first.release()
    second.release()
    end.ep.send(b"ok", [])
    ctl.send((intact, end.counters()))
    end.close()


# ---- unmarked: legacy records none of which is marked last ----------------
#
# The receiver can never make the copies out (they wait for the last
# record), so it refuses the frame rather than deliver tensors with no bytes.


def unmarked_sender(conn, ctl):
    os.environ["TORCH_RPC_EXT_TEST_CUDA_IPC_NO_LAST"] = "1"
    end = End("sender", conn)
    end.send_device(b"u", end.alloc(pattern(4096, 9)), 4096)
    got = end.ep.receive(TIMEOUT)  # nothing: the receiver closes
    ctl.send((got, end.counters()))
    end.close()


def unmarked_receiver(conn, ctl):
    end = End("receiver", conn)
    got = end.ep.receive(TIMEOUT)
    ctl.send((got, end.ep.close_reason(), end.counters()))
    end.close()


# ---- hand back: a received block sent back unchanged costs no copy ---------


def handback_sender(conn, ctl):
    end = End("sender", conn)
    n = 1 << 20
    p = end.alloc(pattern(n, 5))
    end.send_device(b"a", p, n)
    head, (region,) = end.receive()  # our own block, handed back
    back = (head, region.size, end.read_region(region) == pattern(n, 5))
    region.release()  # free in our pool again
    end.send_device(b"b", p, n)
    end.receive()
    ctl.send((back, end.counters()))
    end.close()


def handback_receiver(conn, ctl):
    end = End("receiver", conn)
    head, (region,) = end.receive()
    end.send_device(b"back", region.address, region.size, hand_back=region)
    del region
    head, (region,) = end.receive()
    region.release()
    end.ep.send(b"done", [])
    ctl.send(end.counters())
    end.close()


# ---- handback_kept: the block lent again while our handed-back view lives ---
#
# The receiver hands a block back but keeps its view alive; the owner frees
# the block and lends it again. The new segment gets a lease of its own
# (sharing the handed-back one would never release the block): the third
# segment reuses the block.


def handback_kept_sender(conn, ctl):
    end = End("sender", conn)
    n = 1 << 20
    p = end.alloc(pattern(n, 6))
    end.send_device(b"a", p, n)
    head, (region,) = end.receive()  # our block, handed back
    region.release()
    del region
    for head in (b"b", b"c"):
        end.send_device(head, p, n)
        assert end.receive()[0] == b"ok"
    ctl.send(end.counters())
    end.close()


def handback_kept_receiver(conn, ctl):
    end = End("receiver", conn)
    head, (first,) = end.receive()
    end.send_device(b"back", first.address, first.size, hand_back=first)
    for _ in range(2):
        head, (region,) = end.receive()
        intact = end.read_region(region) == pattern(1 << 20, 6)
        region.release()
        end.ep.send(b"ok", [])
    first.release()  # handed back long ago: nothing to tell
    ctl.send((intact, end.counters()))
    end.close()


# ---- unreached: a CUDA segment to a peer without cuda_ipc -------------------


def unreached_sender(conn, ctl):
    end = End("sender", conn, offer=False)
    p = end.alloc(b"z" * 4096)
    try:
        end.send_device(b"x", p, 4096)
        error = ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        error = f"{type(e).__name__}: {e}"
    end.ep.send(b"after", [])  # the connection still works
    ctl.send((error, end.counters()))
    end.close()


def unreached_receiver(conn, ctl):
    end = End("receiver", conn, offer=False)
    head, segments = end.receive()
    ctl.send((head, segments))
    end.close()


# ---- abandoned: a frame whose later segment no channel takes --------------
#
# The sender sees two devices, the receiver only the first: a frame with a
# segment on each is refused at send(), and the block its first segment took
# (a new one, set up meanwhile) goes back to the pool rather than staying
# lent: the next frame reuses it.


def abandoned_sender(conn, ctl):
    os.environ["FAKE_CUDA_DEVICES"] = "2"
    end = End("sender", conn)
    n = 3 << 20
    p = end.alloc(pattern(n, 4))
    other = end.cu.mem_alloc(1, 4096)
    other_stream = end.cu.stream_create(1)
    try:
        end.ep.send(b"x", [(p, n, CUDA, DEVICE, end.stream),
                           (other, 4096, CUDA, 1, other_stream)], [])
        error = ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        error = str(e)
    end.send_device(b"y", p, n)
    head, _ = end.receive()
    ctl.send((error, head, end.counters()))
    end.cu.stream_synchronize(1, other_stream)
    end.cu.mem_free(1, other)
    end.close()


def abandoned_receiver(conn, ctl):
    os.environ["FAKE_CUDA_DEVICES"] = "1"
    end = End("receiver", conn)
    head, (region,) = end.receive()
    seen = (head, end.read_region(region) == pattern(3 << 20, 4))
    region.release()
    end.ep.send(b"ok", [])
    ctl.send((seen, end.counters()))
    end.close()


# ---- slab_drop, block_drop: a region of a refused frame, behind a stall ----
#
# As `abandoned` (the sender sees two devices, the receiver one): a frame
# refused at send had put its first segment into a new region (a slab of
# shm_slab; a block of cuda_ipc), whose setup frame then queued behind a
# frame the stopped receiver does not read. The region is free, and idle
# past its channel's bound when the heartbeat's ticks trim; the drop a trim
# sends jumps the queue, so the receiver would read the drop of a region it
# never heard of first.

SLAB_CHANNELS = ("shm_slab", "shm_ring", "cuda_ipc")
SLAB_LARGE = 1 << 20  # a slab's (after the connection's one-off)
SLAB_SMALL = 32 << 10  # rides in the stream
STALLED = 512  # 16 MiB of them: more than the socket holds (4 MiB asked)


def refused_behind_a_stall(end, receiver_pid, first, idle_s):
    """Stops the receiver, queues STALLED small segments ahead, sends a
    frame of `first` and a segment on device 1 (which the receiver lacks:
    refused), waits `idle_s` and lets the receiver go. The refusal's text."""
    import ctypes

    small = [ctypes.create_string_buffer(b"s" * SLAB_SMALL, SLAB_SMALL) for _ in range(STALLED)]
    other = end.cu.mem_alloc(1, 4096)
    other_stream = end.cu.stream_create(1)
    os.kill(receiver_pid, signal.SIGSTOP)
    try:
        end.ep.send(b"stalled", [(ctypes.addressof(b), SLAB_SMALL, 0, 0, 0) for b in small])
        try:
            end.ep.send(b"refused", [first, (other, 4096, CUDA, 1, other_stream)], [])
            error = ""
        except Exception as e:  # noqa: BLE001 - the message is the result
            error = str(e)
        time.sleep(idle_s)  # the heartbeat's ticks (every 2 s) trim meanwhile
    finally:
        os.kill(receiver_pid, signal.SIGCONT)
    end.cu.stream_synchronize(1, other_stream)
    end.cu.mem_free(1, other)
    return error


def receive_after_a_stall(end, ctl, frames):
    """The receiver's side: `frames` frames (fewer if the connection
    closed), then its answer and why it closed, if it did."""
    heads = []
    for _ in range(frames):
        got = end.ep.receive(TIMEOUT)
        if got is None:
            break
        heads.append(got[0])
        for segment in got[1]:
            if not isinstance(segment, bytes):
                segment.release()
        del got
    reason = end.ep.close_reason()
    if not reason:
        end.ep.send(b"ok", [])
    ctl.send((heads, reason))
    end.close()


def slab_drop_sender(conn, ctl):
    import ctypes

    os.environ["FAKE_CUDA_DEVICES"] = "2"
    end = End("sender", conn, channels=SLAB_CHANNELS)
    receiver_pid = conn.recv()
    large = ctypes.create_string_buffer(b"L" * SLAB_LARGE, SLAB_LARGE)
    cpu = (ctypes.addressof(large), SLAB_LARGE, 0, 0, 0)
    end.ep.send(b"one-off", [cpu])  # shm_slab's offers are warm after
    error = refused_behind_a_stall(end, receiver_pid, cpu, idle_s=5)
    end.ep.send(b"after", [cpu])
    got = end.ep.receive(TIMEOUT)
    ctl.send((error, got and got[0], end.counters("shm_slab")))
    end.close()


def slab_drop_receiver(conn, ctl):
    os.environ["FAKE_CUDA_DEVICES"] = "1"
    end = End("receiver", conn, channels=SLAB_CHANNELS)
    conn.send(os.getpid())
    receive_after_a_stall(end, ctl, 3)


def block_drop_sender(conn, ctl):
    os.environ["FAKE_CUDA_DEVICES"] = "2"
    end = End("sender", conn)
    receiver_pid = conn.recv()
    n = 3 << 20
    p = end.alloc(pattern(n, 4))
    # Idle 5 s (kBlockIdleMs), then a tick trims it.
    error = refused_behind_a_stall(end, receiver_pid, (p, n, CUDA, DEVICE, end.stream), idle_s=8)
    end.send_device(b"after", p, n)
    got = end.ep.receive(TIMEOUT)
    ctl.send((error, got and got[0], end.counters()))
    end.close()


def block_drop_receiver(conn, ctl):
    os.environ["FAKE_CUDA_DEVICES"] = "1"
    end = End("receiver", conn)
    conn.send(os.getpid())
    receive_after_a_stall(end, ctl, 2)


# ---- gathered: many small segments of one frame share a block and a launch -
#
# A frame of GATHERED small segments (odd sizes) and one large one: the small
# ones are packed into one block at aligned offsets, the large one has its
# own, and one launch copies them all. The receiver hands one small region
# back: it shares its block, so it is copied, not handed back. Its block goes
# back only when the last of its regions is released: the second frame reuses
# both blocks.

GATHERED = [1000 + 37 * i for i in range(300)]
LARGE = 3 << 20


def gathered_frame(end, seed: int) -> list[int]:
    ptrs = [end.alloc(pattern(n, seed + i)) for i, n in enumerate(GATHERED)]
    ptrs.append(end.alloc(pattern(LARGE, seed)))
    sizes = GATHERED + [LARGE]
    end.ep.send(b"g%d" % seed, [(p, n, CUDA, DEVICE, end.stream) for p, n in zip(ptrs, sizes)], [])
    return sizes


def gathered_sender(conn, ctl):
    end = End("sender", conn)
    gathered_frame(end, 0)
    head, (back,) = end.receive()  # one region sent back: a copy
    back_ok = (head, end.read_region(back) == pattern(GATHERED[5], 5))
    del back
    assert end.receive()[0] == b"released"
    after_first = end.counters()
    gathered_frame(end, 1)
    assert end.receive()[0] == b"ok"
    ctl.send((back_ok, after_first, end.counters()))
    end.close()


def gathered_receiver(conn, ctl):
    end = End("receiver", conn)
    seen = []
    for seed in (0, 1):
        head, regions = end.receive()
        sizes = GATHERED + [LARGE]
        intact = all(
            end.read_region(r) == pattern(n, seed + i if i < len(GATHERED) else seed)
            for i, (r, n) in enumerate(zip(regions, sizes))
        )
        small = [r.address for r in regions[:-1]]
        seen.append((head, intact, all(a % 256 == 0 for a in small), max(small) - min(small)))
        if seed == 0:
            end.send_device(b"back", regions[5].address, regions[5].size, hand_back=regions[5])
            imported = end.counters()["blocks_imported"]
            for r in regions:
                r.release()
            del regions
            end.ep.send(b"released", [])
        else:
            for r in regions:
                r.release()
            end.ep.send(b"ok", [])
    ctl.send((seen, imported, end.counters()))
    end.close()


# ---- granted: segments written straight into the receiver's grants ----------
#
# Grants (docs/cuda.md, "Grants") from _testing's grant source of plain
# driver memory (no agent, no torch): m0 lands by copy and earns a 2 MiB
# grant, which m1 goes into; m2 (5 MiB) fits no grant (a grant holds at most
# twice its segment) and earns one in the second slot, which m3 goes into;
# m4 (12 MiB) finds both slots taken, so the receiver revokes the oldest
# grant, the sender gives it back unused, and a 12 MiB grant follows, which
# m5 goes into.

GRANTED = (2 << 20, 2 << 20, 5 << 20, 5 << 20, 12 << 20, 12 << 20)


def wait_for(what, counter: str, value: int) -> int:
    deadline = time.monotonic() + TIMEOUT
    while what()[counter] < value and time.monotonic() < deadline:
        time.sleep(0.01)
    return what()[counter]


def poisoned() -> int | None:
    stats = fake_stats()
    return stats["poisoned_uses"] if stats else None


def send_sizes(conn, ctl, sizes, wait_before=None):
    """A grant scenario's sender: segments of `sizes` one by one, each
    answered b"ok<i>" (and the send of index `wait_before` held until a
    b"idle" comes). Reports the grants each send used, and the counters."""
    testing().use_test_grants()
    end = End("sender", conn)
    data = [end.alloc(pattern(n, i)) for i, n in enumerate(sizes)]
    used = []
    for i, n in enumerate(sizes):
        if i == wait_before:
            assert end.receive()[0] == b"idle"
        before = end.counters()["grants_used"]
        end.send_device(b"m%d" % i, data[i], n)
        used.append(end.counters()["grants_used"] - before)
        head, _ = end.receive()
        assert head == b"ok%d" % i, head
    ctl.send((used, end.counters()))
    end.close()


def receive_sizes(end, sizes, before_reply=None) -> list:
    """A grant scenario's receiver: each segment of `sizes` read, checked
    and released, then answered b"ok<i>" (after `before_reply(i)`, if
    given). Returns [(head, intact)]."""
    seen = []
    for i, n in enumerate(sizes):
        head, (region,) = end.receive()
        seen.append((head, end.read_region(region) == pattern(n, i)))
        region.release()
        if before_reply is not None:
            before_reply(i)
        end.ep.send(b"ok%d" % i, [])
    return seen


def granted_sender(conn, ctl):
    send_sizes(conn, ctl, GRANTED)


def granted_receiver(conn, ctl):
    testing().use_test_grants()
    end = End("receiver", conn)

    def before_reply(i):
        if i == 4:
            # The 12 MiB grant is made once the oldest is back: out before
            # this reply, so the sender has it for m5.
            wait_for(end.counters, "grants_made", 5)

    seen = receive_sizes(end, GRANTED, before_reply)
    counters = end.counters()
    end.close()
    ctl.send((seen, counters, testing().test_grant_counts(), poisoned()))


# ---- grant_unopened: grants whose segments the sender cannot map -----------
#
# The sender's cuIpcOpenMemHandle fails ($FAKE_CUDA_IPC_MEM_OPEN_FAILS): it
# holds each grant unused, every segment goes by block, and the receiver
# grants no size twice. A third size takes back the oldest grant, which the
# sender gives back.

UNOPENED = (2 << 20, 2 << 20, 5 << 20, 12 << 20)


def grant_unopened_sender(conn, ctl):
    os.environ["FAKE_CUDA_IPC_MEM_OPEN_FAILS"] = "1"
    testing().use_test_grants()
    end = End("sender", conn)
    for i, n in enumerate(UNOPENED):
        end.send_device(b"m%d" % i, end.alloc(pattern(n, i)), n)
        head, _ = end.receive()
        assert head == b"ok%d" % i, head
    ctl.send(end.counters())
    end.close()


def grant_unopened_receiver(conn, ctl):
    testing().use_test_grants()
    end = End("receiver", conn)

    def before_reply(i):
        if i == len(UNOPENED) - 1:
            wait_for(end.counters, "grants_made", 3)  # after the return

    seen = receive_sizes(end, UNOPENED, before_reply)
    time.sleep(0.3)  # a grant made again and again would show by now
    counters = end.counters()
    end.close()
    ctl.send((seen, counters))


# ---- grant_unshared: grants whose segments the receiver cannot share -------
#
# The receiver's cuIpcGetMemHandle fails ($FAKE_CUDA_IPC_MEM_HANDLE_FAILS):
# each grant it makes after a 3 MiB segment cannot be sent, and is dropped
# (its memory and its share of the bound given back), so the next segment
# of that size earns one again. Before, it was held unsent to the close:
# no other grant of its size was made, and its memory stayed out.

UNSHARED = (3 << 20,) * 3


def grant_unshared_sender(conn, ctl):
    send_sizes(conn, ctl, UNSHARED)


def grant_unshared_receiver(conn, ctl):
    os.environ["FAKE_CUDA_IPC_MEM_HANDLE_FAILS"] = "1"
    testing().use_test_grants()
    end = End("receiver", conn)
    seen = receive_sizes(end, UNSHARED)
    counts = testing().test_grant_counts
    wait_for(counts, "freed", len(UNSHARED))
    out = (seen, end.counters(), counts())
    end.close()
    ctl.send(out)


# ---- grant_late_copy: a copy into a grant still queued at the close --------
#
# m0 earns a 3 MiB grant; m1 goes into it by a copy that runs 6 s late (the
# fake's kernel delay, set only then), and the sender closes at once. Its
# mapping of the receiver's segment must stay open until that copy ran,
# past the teardown's 2 s deadline: closed under it, the copy would write
# into memory no longer mapped (on the fake, the close drains the streams
# first, so it would sit in cuIpcCloseMemHandle from the deadline on). The
# receiver exits once the connection closed, before its own deadline frees
# the segment (a dead exporter's memory is the driver's to keep).

LATE_DELAY_MS = 6000


def grant_late_copy_sender(conn, ctl):
    testing().use_test_grants()
    end = End("sender", conn)
    n = 3 << 20
    end.send_device(b"m0", end.alloc(pattern(n, 0)), n)
    assert end.receive()[0] == b"ok0"
    # m0's block goes once idle (5 s): freed at the close's deadline, it
    # would hold the staging thread in cuMemFree until the late copy ran
    # (the driver's free waits for the device), and the mapping's close
    # with it, hiding what this checks.
    calls = lambda: fake_stats()["calls"]  # noqa: E731
    frees = lambda: calls().get("cuMemRelease", 0) + calls().get("cuMemFree", 0)  # noqa: E731
    before_frees = frees()
    deadline = time.monotonic() + 20
    while frees() == before_frees and time.monotonic() < deadline:
        time.sleep(0.1)
    data = end.alloc(pattern(n, 1))
    set_fake_kernel_delay(LATE_DELAY_MS)
    before = end.counters()["grants_used"]
    end.send_device(b"m1", data, n)
    used = end.counters()["grants_used"] - before
    end.ep.close()
    closed_at = time.monotonic()
    closes = lambda: calls().get("cuIpcCloseMemHandle", 0)  # noqa: E731
    time.sleep(4)  # past the 2 s deadline, before the copy ran
    at_4s = closes()
    while closes() == 0 and time.monotonic() < closed_at + 20:
        time.sleep(0.05)
    closed_after = time.monotonic() - closed_at
    end.cu.stream_synchronize(DEVICE, end.stream)
    ctl.send((used, at_4s, closes(), round(closed_after, 1), poisoned()))
    for p in end.live:
        end.cu.mem_free(DEVICE, p)


def grant_late_copy_receiver(conn, ctl):
    testing().use_test_grants()
    end = End("receiver", conn)
    head, (region,) = end.receive()
    assert head == b"m0" and end.read_region(region) == pattern(3 << 20, 0)
    region.release()
    end.ep.send(b"ok0", [])
    deadline = time.monotonic() + 30
    while not end.ep.close_reason() and time.monotonic() < deadline:
        time.sleep(0.05)
    ctl.send(end.ep.close_reason())
    os._exit(0)  # at once: its segments are the driver's to keep


# ---- grant_abandoned: a grant written for a frame refused at send ----------
#
# As `abandoned` (the sender sees two devices, the receiver one), with
# grants: m0 earns a 3 MiB grant; the next frame's first segment is written
# into it and its second refused, so the grant goes back unasked once that
# copy is done, and the receiver grants again, which m3 goes into.


def refused_after_a_grant(end, n, before_send=lambda: None):
    """m0 earns the sender (with FAKE_CUDA_DEVICES=2) a grant of `n` bytes;
    then a frame whose first segment goes into it and whose second, on a
    device the receiver does not have, is refused at send. Returns the
    send's error ("" if none), and the second segment's memory and stream
    (device 1)."""
    end.send_device(b"m0", end.alloc(pattern(n, 0)), n)
    assert end.receive()[0] == b"ok0"
    other = end.cu.mem_alloc(1, 4096)
    other_stream = end.cu.stream_create(1)
    data = end.alloc(pattern(n, 1))
    before_send()
    try:
        end.ep.send(b"x", [(data, n, CUDA, DEVICE, end.stream),
                           (other, 4096, CUDA, 1, other_stream)], [])
        return "", other, other_stream
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e), other, other_stream


def grant_abandoned_sender(conn, ctl):
    os.environ["FAKE_CUDA_DEVICES"] = "2"
    testing().use_test_grants()
    end = End("sender", conn)
    n = 3 << 20
    error, other, other_stream = refused_after_a_grant(end, n)
    returned = wait_for(end.counters, "grants_returned", 1)
    end.send_device(b"m2", end.alloc(pattern(n, 2)), n)
    assert end.receive()[0] == b"ok2"  # after the grant made on the return
    before = end.counters()["grants_used"]
    end.send_device(b"m3", end.alloc(pattern(n, 3)), n)
    m3 = end.counters()["grants_used"] - before
    assert end.receive()[0] == b"ok3"
    ctl.send((error, returned, m3, end.counters()))
    end.cu.stream_synchronize(1, other_stream)
    end.cu.mem_free(1, other)
    end.close()


def grant_abandoned_receiver(conn, ctl):
    os.environ["FAKE_CUDA_DEVICES"] = "1"
    testing().use_test_grants()
    end = End("receiver", conn)
    seen = []
    for i in (0, 2, 3):
        head, (region,) = end.receive()
        seen.append((head, end.read_region(region) == pattern(3 << 20, i)))
        region.release()
        end.ep.send(b"ok%d" % i, [])
    counters = end.counters()
    end.close()
    ctl.send((seen, counters, poisoned()))


# ---- grant_idle: a grant left unused is taken back ---------------------------
#
# The receiver takes back a grant unused for 300 ms (set so only while the
# sender waits: $TORCH_RPC_EXT_CUDA_GRANT_IDLE_MS=0, never, before): m0
# earns a grant, m1 goes into it and earns the next, which stays unused
# until the receiver revokes it and the sender gives it back; none follows
# (its memory and its share of the bound are free again). m2 lands by copy
# and earns a grant, which m3 goes into.

IDLE = 3 << 20


def grant_idle_sender(conn, ctl):
    send_sizes(conn, ctl, (IDLE,) * 4, wait_before=2)


def grant_idle_receiver(conn, ctl):
    os.environ["TORCH_RPC_EXT_CUDA_GRANT_IDLE_MS"] = "0"
    testing().use_test_grants()
    end = End("receiver", conn)
    seen, out = [], []
    for i in range(4):
        head, (region,) = end.receive()
        seen.append((head, end.read_region(region) == pattern(IDLE, i)))
        region.release()
        end.ep.send(b"ok%d" % i, [])
        if i == 1:
            wait_for(end.counters, "grants_made", 2)  # m1's successor
            out.append(testing().test_grant_counts()["grant_bytes"])
            testing().set_grant_idle_ms(300)
            wait_for(end.counters, "grants_idle", 1)
            deadline = time.monotonic() + TIMEOUT
            while testing().test_grant_counts()["grant_bytes"] and time.monotonic() < deadline:
                time.sleep(0.01)  # until the sender gave it back
            time.sleep(0.3)  # nothing made again meanwhile
            out.append(testing().test_grant_counts()["grant_bytes"])
            out.append(end.counters()["grants_made"])
            testing().set_grant_idle_ms(0)  # (m2's grant waits for m3)
            end.ep.send(b"idle", [])
    counters = end.counters()
    end.close()
    ctl.send((seen, out, counters, poisoned()))


# ---- grant_limit: grants count against cuda_ipc's bound -----------------------
#
# The receiver's bound is 6 MiB a device (cuda_ipc_memory_limit), so 3 MiB
# for grants: m0 (2 MiB) earns a 2 MiB grant; m1 and m2 (5 MiB) would earn
# 6 MiB ones, past it, so none is made and they land by copy; m3 goes into
# the 2 MiB grant.

LIMITED = (2 << 20, 5 << 20, 5 << 20, 2 << 20)


def grant_limit_sender(conn, ctl):
    send_sizes(conn, ctl, LIMITED)


def grant_limit_receiver(conn, ctl):
    testing().use_test_grants(memory_limit=6 << 20)
    end = End("receiver", conn)
    out = []

    def before_reply(i):
        # (Each decided at the frame's end: by now, or soon.)
        if i in (1, 2):
            wait_for(end.counters, "grants_over_limit", i)
        else:
            wait_for(end.counters, "grants_made", 1 if i == 0 else 2)
        out.append(testing().test_grant_counts()["grant_bytes"])

    seen = receive_sizes(end, LIMITED, before_reply)
    counters = end.counters()
    end.close()
    ctl.send((seen, out, counters))


# ---- grant_room: no grant revoked for a size the bound has no room for -----
#
# A 12 MiB bound, so 6 MiB for grants: m0 (2 MiB) and m1 (4 MiB) earn a grant
# each, both slots, 6 MiB; m2 (5 MiB) would take the oldest's slot, but a
# 6 MiB grant has no room even with that one's 2 MiB back, so nothing is
# revoked; m3 and m4 go into the two grants.

ROOM = (2 << 20, 4 << 20, 5 << 20, 2 << 20, 4 << 20)


def grant_room_sender(conn, ctl):
    send_sizes(conn, ctl, ROOM)


def grant_room_receiver(conn, ctl):
    testing().use_test_grants(memory_limit=12 << 20)
    end = End("receiver", conn)

    def before_reply(i):
        if i < 2:
            wait_for(end.counters, "grants_made", i + 1)
        elif i == 2:
            wait_for(end.counters, "grants_over_limit", 1)

    seen = receive_sizes(end, ROOM, before_reply)
    counters = end.counters()
    end.close()
    ctl.send((seen, counters))


if __name__ == "__main__":  # pragma: no cover - used by spawn only
    os._exit(1)


# ---- unwaited: a region let go without a wait still orders the next fill ------
#
# A frame that never lands (another of its segments failed) drops its regions
# with no stream having waited on them. The sender's next copy into the block
# waits only on `released`: it must still follow the sender's own last copy
# into it, which ran late here.

UNWAITED = 1 << 20


def unwaited_sender(conn, ctl):
    end = End("sender", conn)
    first = end.alloc(pattern(UNWAITED, 1))
    set_fake_kernel_delay(800)  # the first copy into the block runs late
    end.send_device(b"1", first, UNWAITED)
    set_fake_kernel_delay(0)
    head, _ = end.receive()  # the block's release rode it
    assert head == b"dropped"
    other = end.cu.stream_create(DEVICE)
    second = end.alloc(pattern(UNWAITED, 2))
    end.ep.send(b"2", [(second, UNWAITED, CUDA, DEVICE, other)], [None])
    head, _ = end.receive()
    end.cu.stream_synchronize(DEVICE, other)
    ctl.send((head, end.counters()))
    end.close()


def unwaited_receiver(conn, ctl):
    end = End("receiver", conn)
    head, (region,) = end.receive()
    region.release()  # never waited on
    del region
    end.ep.send(b"dropped", [])
    head, (region,) = end.receive()
    at_once = end.read_region(region) == pattern(UNWAITED, 2)
    time.sleep(1.2)  # past the late copy
    later = end.cu.read(DEVICE, region.address, UNWAITED) == pattern(UNWAITED, 2)
    region.release()
    end.ep.send(b"done", [])
    ctl.send((at_once, later, end.counters()))
    end.close()


# ---- ring_dropped: a frame refused at send leaves the ring's copy stream free ----
#
# A frame whose large segment went to cuda_ring, its snapshot queued behind
# the caller's stream (which a gate holds), is refused at send() by a later
# segment no channel takes (a device this process does not have). Its end
# must not make the copies out of every later segment of the device (one
# copy stream, shared by every connection) wait for that stream: the next
# frame, from another stream, arrives while the gate is still shut.

RING_DROPPED = 4 << 20
NO_SUCH_DEVICE = 7


def ring_dropped_sender(conn, ctl):
    end = End("sender", conn, channels=("cuda_ring", "cuda_staged"))
    p = end.alloc(pattern(RING_DROPPED, 4))
    gate = end.cu.gate_stream(DEVICE, end.stream)  # the caller's work, stuck
    try:
        end.ep.send(b"x", [(p, RING_DROPPED, CUDA, DEVICE, end.stream),
                           (p, 4096, CUDA, NO_SUCH_DEVICE, end.stream)], [])
        error = ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        error = str(e)
    stream = end.cu.stream_create(DEVICE)
    q = end.alloc(pattern(RING_DROPPED, 5))
    end.ep.send(b"y", [(q, RING_DROPPED, CUDA, DEVICE, stream)], [])
    got = end.ep.receive(10)  # the gate still shut
    end.cu.open_gate(gate)
    in_time = got is not None
    if got is None:
        got = end.receive()
    ctl.send((error, got[0], in_time, end.counters("cuda_ring")))
    end.cu.stream_synchronize(DEVICE, stream)
    end.close()


def ring_dropped_receiver(conn, ctl):
    end = End("receiver", conn, channels=("cuda_ring", "cuda_staged"))
    head, regions = end.receive()
    seen = (head, len(regions), end.read_region(regions[0]) == pattern(RING_DROPPED, 5))
    for region in regions:
        region.release()
    end.ep.send(b"ok", [])
    ctl.send((seen, end.counters("cuda_ring")))
    end.close()


# ---- legacy_oom: no memory to copy a legacy segment out into ------------------
#
# The receiver may hold LEGACY_LIMIT of device memory: a segment larger than
# that cannot be copied out of the sender's legacy block. Its message fails
# (a failed region, which the agent turns into its call's error); the
# connection stays, the block is released, and the next message lands.

LEGACY_LIMIT = 3 << 20
LEGACY_TOO_BIG = 4 << 20


def legacy_oom_sender(conn, ctl):
    end = End("sender", conn)
    p = end.alloc(pattern(LEGACY_TOO_BIG, 1))
    end.send_device(b"big", p, LEGACY_TOO_BIG)
    assert end.receive()[0] == b"r0"
    q = end.alloc(pattern(4096, 2))
    end.send_device(b"small", q, 4096)
    head, _ = end.receive()
    ctl.send((head, end.counters()))
    end.close()


def legacy_oom_receiver(conn, ctl):
    os.environ["FAKE_CUDA_MEM_LIMIT"] = str(LEGACY_LIMIT)
    end = End("receiver", conn)
    head, (first,) = end.receive()
    end.ep.send(b"r0", [])
    head2, (region,) = end.receive()
    second = (head2, end.read_region(region) == pattern(4096, 2))
    region.release()
    # Read before r1: once the sender has it, it closes (then the reason
    # says so, on a host that ran us late).
    reason = end.ep.close_reason()
    end.ep.send(b"r1", [])
    ctl.send(((head, first), second, reason, end.counters()))
    end.close()
