# SPDX-License-Identifier: BSD-3-Clause
"""Fuzz a live TORCH_RPC_EXT agent through its listening sockets.

Two workers: worker1 is the target; worker0 keeps calling it (and checking
every answer) while a fuzzer thread in the same process opens connections to
worker1's TCP and shm addresses and sends, case by case:

  garbage       random bytes
  absurd        a well-formed header announcing absurd lengths or counts
  truncated     a valid hello cut short, then our write side closed
  mutated       a valid hello with random bytes flipped
  slow_drip     a valid hello, one byte every 0.2 s (outlives handshake_timeout)
  auth_mutated  a full handshake with the secret, then a valid message frame
                (a response to no call) with random bytes flipped
  auth_absurd   a full handshake, then a header over max_frame_bytes
  auth_slab     (shm address; auth_mutated on TCP) a full handshake, a sealed
                shared slab handed over, then slab-protocol frames with random
                fields: message frames whose segments point into slabs
                (random ids, record kinds, offsets), releases and drops of
                random slabs, more setups of random capacity

Outcomes per case: "closed" (the agent hung up), or "open" after the wait
(acceptable only for auth_mutated and auth_slab frames that still parse: they
are dropped as late responses). A pre-authentication case still open after
the longest a handshake may last (6 handshake timeouts: a starved host
stretches the timeout, csrc/transport/stream/connection.cpp) plus 1 s is a
hang; a case the agent closes returns as soon as it does. The target must stay alive, every legit
call must succeed, and its peak RSS may not grow by more than a few frames'
worth (max_frame_bytes is 1 MiB here).

  python benchmarks/fuzz_agent.py --cases 20000 --seed 1   # the long run
  python benchmarks/fuzz_agent.py --cases 350 --legit-pause-ms 2  # CI's round

worker0's calls go back to back by default (about 2,000 a second on a
2-core VM, a core's worth of CPU between the two workers); --legit-pause-ms
spaces them, for a round that must leave the cores to other work (CI's: 2
ms apart, about 200 a second, still throughout the round).

Prints one JSON line with the totals.
"""

import argparse
import json
import os
import random
import resource
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import torch
from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import run_world  # noqa: E402

SECRET = b"fuzz-secret-fuzz-secret-fuzz-sec"
HANDSHAKE_TIMEOUT = 1.0
MAX_HANDSHAKE_TIMEOUTS = 6  # kMaxHandshakeTimeouts in csrc/transport/stream/connection.cpp
MAX_FRAME = 1 << 20
KINDS = ["garbage", "absurd", "truncated", "mutated", "slow_drip", "auth_mutated", "auth_absurd",
         "auth_slab"]


def _target_info():
    agent = rpc.api._get_current_rpc_agent()
    info = agent.get_debug_info()
    return {"tcp": info["rpc_ext.listen.tcp"], "shm": info.get("rpc_ext.listen.shm"),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _target_metrics():
    m = rpc.api._get_current_rpc_agent().get_metrics()
    return {k: v for k, v in m.items() if "rejected" in k or k.endswith("late_responses")}


def _hello():
    from torch_rpc_ext.testing import HELLO, frame_header

    return frame_header(HELLO, 36) + struct.pack("<i", 0) + os.urandom(32)


def _flip(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def _message_frame(rng: random.Random) -> bytes:
    from torch_rpc_ext import _testing
    from torch_rpc_ext.testing import MESSAGE, frame_header

    tensors = [torch.randn(rng.randint(0, 64)) for _ in range(rng.randint(0, 3))]
    # SCRIPT_RET (a response) with an id no call has: parsed, then dropped.
    head, segs = _testing.encode_message(0x8002, os.urandom(rng.randint(0, 64)), tensors,
                                         rng.randint(1 << 40, 1 << 50))
    return (frame_header(MESSAGE, len(head), nseg=len(segs), data=sum(map(len, segs)))
            + b"".join(struct.pack("<Q", len(s)) for s in segs) + head + b"".join(segs))


def _sealed_slab(size: int) -> int:
    import fcntl

    fd = os.memfd_create("fuzz-slab", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


def _slab_case(sock: socket.socket, rng: random.Random) -> None:
    """Hand over one sealed 2 MiB slab (id 1), then send random slab-protocol
    frames. The shm_slab protocol: csrc/channel/shm/slab.h, docs/wire-format.md."""
    from torch_rpc_ext import _testing
    from torch_rpc_ext.testing import (
        MESSAGE,
        SLAB,
        SLAB_DROP,
        SLAB_RELEASE,
        frame_header,
    )

    slab = 2 << 20
    fd = _sealed_slab(slab)
    try:
        socket.send_fds(sock, [frame_header(SLAB, 12) + struct.pack("<IQ", 1, slab)], [fd])
        for _ in range(rng.randint(1, 4)):
            what = rng.random()
            if what < 0.6:
                n = rng.choice([1, 100, 70_000, 200_000])
                head, segs = _testing.encode_message(
                    0x8002, b"", [torch.zeros(n)], rng.randint(1 << 40, 1 << 50))
                size = len(segs[1])
                record = struct.pack("<IIQ", rng.choice([1, 1, 2, rng.randrange(1 << 32)]),
                                     rng.choice([1, 1, 2, rng.randrange(1 << 32)]),
                                     rng.choice([0, 0, slab - size, rng.randrange(1 << 64)]))
                frame = (frame_header(MESSAGE, len(head), nseg=2, data=len(segs[0]) + size)
                         + struct.pack("<QQ", len(segs[0]), size | (1 << 56)) + head  # channel 1: shm_slab
                         + segs[0] + record)
                if rng.random() < 0.3:
                    frame = frame[:4] + _flip(frame[4:], rng)
                sock.sendall(frame)
            elif what < 0.8:
                ids = [rng.choice([1, 2, rng.randrange(1 << 32)]) for _ in range(rng.randint(1, 4))]
                kind = rng.choice([SLAB_RELEASE, SLAB_DROP])
                if kind == SLAB_DROP:
                    ids = ids[:1]
                sock.sendall(frame_header(kind, 4 * len(ids)) + struct.pack(f"<{len(ids)}I", *ids))
            else:
                size = rng.choice([4096, 1 << 20, 3 << 20, rng.randrange(1 << 40)])
                fd2 = _sealed_slab(4096)
                try:
                    socket.send_fds(sock, [frame_header(SLAB, 12) + struct.pack(
                        "<IQ", rng.choice([1, 2, rng.randrange(1 << 32)]), size)], [fd2])
                finally:
                    os.close(fd2)
    finally:
        os.close(fd)


def _send_case(kind: str, address: str, rng: random.Random) -> str:
    from torch_rpc_ext.testing import (
        HELLO,
        MESSAGE,
        closed_by_peer,
        connect_raw,
        frame_header,
        handshake,
    )

    wait = HANDSHAKE_TIMEOUT * MAX_HANDSHAKE_TIMEOUTS + 1
    if kind == "auth_slab":
        sock, _ = handshake(address, SECRET)
        try:
            _slab_case(sock, rng)
        except OSError:
            sock.close()
            return "closed"
        sock.settimeout(0.3)
        closed = closed_by_peer(sock)
        sock.close()
        return "closed" if closed else "open"
    if kind.startswith("auth_"):
        sock, _ = handshake(address, SECRET)
        if kind == "auth_mutated":
            frame = _message_frame(rng)
            # Keep the magic intact half the time, to get past the header.
            cut = 4 if rng.random() < 0.5 else 0
            data = frame[:cut] + _flip(frame[cut:], rng)
            # A mutation may leave a frame the agent accepts and answers
            # (the connection stays open): not waited out for long.
            wait = 0.3
        else:
            # Refused at its header for certain: the closing is waited for
            # as long as any (a loaded host's loop may be late by 0.3 s).
            data = frame_header(MESSAGE, 8, nseg=1, data=MAX_FRAME * rng.randint(2, 1 << 20))
    else:
        sock = connect_raw(address)
        if kind == "garbage":
            data = os.urandom(rng.randint(1, 4096))
        elif kind == "absurd":
            data = frame_header(rng.choice([HELLO, MESSAGE]), rng.choice([36, 1 << 31]),
                                nseg=rng.choice([0, 1 << 31]), data=rng.randint(1 << 20, 1 << 63))
        elif kind == "truncated":
            data = _hello()[: rng.randint(1, 59)]
        elif kind == "mutated":
            data = _flip(_hello(), rng)
        else:  # slow_drip
            data = b""
            sock.settimeout(0.2)
            for byte in _hello():
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    break
                if closed_by_peer(sock):
                    sock.close()
                    return "closed"
    try:
        sock.sendall(data)
        if kind == "truncated":
            sock.shutdown(socket.SHUT_WR)
    except OSError:
        sock.close()
        return "closed"
    sock.settimeout(wait)
    closed = closed_by_peer(sock)
    sock.close()
    return "closed" if closed else "open"


def fuzz(rank, world_size, cases, seed, legit_pause_s=0.0):
    import torch_rpc_ext

    rpc.init_rpc(
        f"worker{rank}", rank=rank, world_size=world_size,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
            secret=SECRET, address="127.0.0.1", max_frame_bytes=MAX_FRAME,
            handshake_timeout=HANDSHAKE_TIMEOUT, rpc_timeout=30),
    )
    out = {}
    if rank == 0:
        info = rpc.rpc_sync("worker1", _target_info)
        addresses = [a for a in (info["tcp"], info["shm"]) if a]
        stop = threading.Event()
        legit = {"ok": 0, "bad": 0}

        def traffic():
            k = 0
            while not stop.is_set():
                k += 1
                # Every third call large enough for the shm slabs.
                x = torch.full((30_000 if k % 3 == 0 else 1000,), float(k))
                try:
                    ok = torch.equal(rpc.rpc_sync("worker1", torch.add, args=(x, 1)), x + 1)
                except RuntimeError:
                    ok = False
                legit["ok" if ok else "bad"] += 1
                if legit_pause_s:
                    stop.wait(legit_pause_s)

        t = threading.Thread(target=traffic)
        t.start()
        rng = random.Random(seed)
        tally = {k: {"closed": 0, "open": 0} for k in KINDS}
        hangs, started = 0, time.monotonic()
        for i in range(cases):
            kind = KINDS[i % len(KINDS)]
            if kind == "slow_drip" and i % (len(KINDS) * 10) != 4:
                kind = "garbage"  # slow drips take seconds: one in ten rounds
            address = addresses[i % len(addresses)]
            if kind == "auth_slab":
                if info["shm"] is None:
                    kind = "auth_mutated"
                else:
                    address = info["shm"]
            outcome = _send_case(kind, address, rng)
            tally[kind][outcome] += 1
            if outcome == "open" and kind not in ("auth_mutated", "auth_slab"):
                hangs += 1
        stop.set()
        t.join()
        after = rpc.rpc_sync("worker1", _target_info)
        out = {"cases": cases, "seed": seed, "seconds": round(time.monotonic() - started, 1),
               "by_kind": tally, "hangs": hangs, "legit_calls_ok": legit["ok"],
               "legit_calls_failed": legit["bad"],
               "target_peak_rss_mb": {"before": info["peak_rss_mb"], "after": after["peak_rss_mb"]},
               "target_metrics": rpc.rpc_sync("worker1", _target_metrics)}
    rpc.shutdown()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--legit-pause-ms", type=float, default=0.0,
                   help="pause between worker0's calls (default: none, back to back)")
    args = p.parse_args(argv)
    r, _ = run_world(fuzz, 2, args.cases, args.seed, args.legit_pause_ms / 1000, timeout=36000)
    print(json.dumps(r))
    return 0 if r["hangs"] == 0 and r["legit_calls_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
