# SPDX-License-Identifier: BSD-3-Clause
"""Writes the seed corpus of the libFuzzer targets: tests/fuzz/corpus/<target>/.

Each seed is an input in its target's layout (written at the top of
tests/fuzz/fuzz_<target>.cpp) that reaches a state deep enough for the fuzzer
to start from: valid headers of every kind, complete handshakes in both
roles, real message frames (encoded by the extension itself, so this needs
the built torch_rpc_ext), attached rings and slabs with operations on them.
It rewrites the seed-* files and leaves the others (reproducers of past
findings) alone:

    python tests/fuzz/make_seeds.py
"""

import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def pick(predicate):
    """The smallest op byte with `predicate` (ops carry operands in their bits)."""
    return next(op for op in range(256) if predicate(op))


def u16(v):
    return struct.pack("<H", v)


def u32(v):
    return struct.pack("<I", v)


def u64(v):
    return struct.pack("<Q", v)


def i32(v):
    return struct.pack("<i", v)


# --- frame -----------------------------------------------------------------

FRAME_MAGIC = 0x58505254
DEFAULT_LIMITS, FUZZ_AGENT_LIMITS, CUSTOM_LIMITS = b"\0", b"\1", b"\2"


def protocol_version():
    from torch_rpc_ext import _testing

    return _testing.PROTOCOL_VERSION


def frame_header(kind, flags=0, head=0, segments=0, data=0, magic=FRAME_MAGIC,
                 version=None):
    version = protocol_version() if version is None else version
    return struct.pack("<IBBHIIQ", magic, version, kind, flags, head, segments,
                       data)


def frame_seeds():
    # The channels' kinds: shm_slab 16-18, shm_ring 24-25, cuda_ipc 32-34.
    for kind in [*range(1, 8), 15, *range(16, 20), 24, 25, 32, 33, 34, 255]:
        write("frame", f"kind{kind}", frame_header(kind, head=36) + DEFAULT_LIMITS)
    write("frame", "message",
          frame_header(4, head=100, segments=3, data=4096) + DEFAULT_LIMITS)
    write("frame", "ring-flag",
          frame_header(4, flags=1, segments=1, data=1 << 20) + DEFAULT_LIMITS)
    # max_frame_bytes = 1 MiB: exactly at the limit, and one byte over.
    room = (1 << 20) - (24 + 8 * 2 + 64)
    write("frame", "at-limit",
          frame_header(4, head=64, segments=2, data=room) + FUZZ_AGENT_LIMITS)
    write("frame", "over-limit",
          frame_header(4, head=64, segments=2, data=room + 1) + FUZZ_AGENT_LIMITS)
    # Custom limits, and candidates for 64-bit wrap-around.
    write("frame", "custom-limits",
          frame_header(4, head=8, segments=1, data=32) + CUSTOM_LIMITS
          + struct.pack("<QII", 72, 8, 1))
    write("frame", "wrap",
          frame_header(4, head=0xFFFF, segments=0xFFFF, data=(1 << 64) - 16)
          + CUSTOM_LIMITS + struct.pack("<QII", (1 << 64) - 1, 2**32 - 1, 2**32 - 1))
    write("frame", "bad-magic", frame_header(1, magic=0x12345678) + DEFAULT_LIMITS)
    write("frame", "bad-version",
          frame_header(1, version=protocol_version() - 1) + DEFAULT_LIMITS)


# --- handshake ---------------------------------------------------------------

RAW, VALID, FLIP, RESIZE = range(4)


def handshake_seeds():
    nonce = bytes(range(32))
    inc = bytes(range(2, 10))  # even: admitted by the harness's rule
    odd = bytes([1]) + bytes(7)  # refused by it
    # Server role (config bit 0 clear): hello, proof, then a replay.
    server = b"\0" + i32(0) + i32(-1) + i32(1)
    hello = bytes([VALID]) + inc + nonce
    write("handshake", "server-complete", server + hello + bytes([VALID, VALID]))
    write("handshake", "server-bad-proof", server + hello + bytes([FLIP, 5, 0x80]))
    write("handshake", "server-short-proof", server + hello + bytes([RESIZE, 31]))
    write("handshake", "server-refused-incarnation",
          server + bytes([VALID]) + odd + nonce + bytes([VALID]))
    write("handshake", "server-negative-id",
          b"\0" + i32(0) + i32(-1) + i32(-7) + hello)
    write("handshake", "server-raw-hello", server + bytes([RAW, 44]) + i32(3) + inc + nonce)
    write("handshake", "server-wrong-secret",
          b"\2" + i32(0) + i32(-1) + i32(1) + hello + bytes([VALID]))
    # Client role (bit 0), the peer claiming the expected id (bit 2): a
    # challenge, then the server's proof.
    client = b"\5" + i32(1) + i32(0) + i32(0)
    write("handshake", "client-complete", client + hello + bytes([VALID, VALID]))
    write("handshake", "client-refused-incarnation",
          client + bytes([VALID]) + odd + nonce + bytes([VALID]))
    write("handshake", "client-bad-proof", client + hello + bytes([FLIP, 5, 0x80]))
    write("handshake", "client-short-proof", client + hello + bytes([RESIZE, 31]))
    write("handshake", "client-wrong-id", b"\1" + i32(1) + i32(0) + i32(5) + hello)
    write("handshake", "client-wrong-secret",
          b"\7" + i32(1) + i32(0) + i32(0) + hello + bytes([VALID]))
    write("handshake", "client-long", client + bytes([RESIZE]) + inc + nonce + bytes([81, 0]))


# --- codec -------------------------------------------------------------------

PROVIDED, POOL_SIZED = 1, 2


def codec_input(head, segments, flags=None, use_pool=False):
    """nseg; per segment flags, uint16 size; pool; uint16 head length; head; bytes.

    A POOL_SIZED segment is BufferPool::kMinPooledBytes longer than its bytes
    here (the target repeats the bytes over it).
    """
    flags = flags or [0] * len(segments)
    out = bytes([len(segments)])
    for f, s in zip(flags, segments):
        assert len(s) < 1 << 16, "seed segments must fit a uint16"
        out += struct.pack("<BH", f, len(s))
    out += bytes([1 if use_pool else 0]) + u16(len(head)) + head
    return out + b"".join(segments)


def codec_seeds():
    import torch

    from torch_rpc_ext import _testing

    call, ret = 0x02 | 0x100, 0x03 | 0x200  # PYTHON_CALL, PYTHON_RET

    def enc(tensors, payload=b"payload", type_=call):
        head, segments = _testing.encode_message(type_, payload, tensors, 7)
        return head, [bytes(s) for s in segments]

    def sparse(i, v, size):
        with torch.sparse.check_sparse_tensor_invariants():
            return torch.sparse_coo_tensor(i, v, size)

    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    base = torch.arange(40, dtype=torch.int64)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([3.0, 4.0, 5.0])
    dtypes = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
              torch.float16, torch.bfloat16, torch.complex64)
    cases = {
        "empty": enc([], b""),
        "payload-only": enc([], b"a pickled call", ret),
        "dense": enc([x]),
        "transposed": enc([x.t()]),
        "strided": enc([base[::3]]),
        "shared-storage": enc([base[2:10], base[20:30]]),
        "scalar": enc([torch.tensor(2.5, dtype=torch.float64)]),
        "zero-size": enc([torch.empty(0, 5)]),
        "requires-grad": enc([torch.ones(4, requires_grad=True)]),
        "dtypes": enc([torch.ones(2, dtype=d) for d in dtypes]),
        "sparse": enc([sparse(i, v, (2, 3)).coalesce()]),
        "sparse-uncoalesced": enc([sparse(i, v, (2, 3))]),
        "sparse-hybrid": enc([sparse(torch.tensor([[0, 2]]), torch.ones(2, 3),
                                     (4, 3))]),
        "mixed": enc([x, sparse(i, v, (2, 3)), base[5:9]]),
        "quantized": enc([torch.quantize_per_tensor(x, 0.5, 3, torch.qint8),
                          torch.quantize_per_channel(x, torch.tensor([0.1, 0.2, 0.3]),
                                                     torch.tensor([0, 1, 2]), 0, torch.quint8),
                          torch.quantize_per_channel(x.t(), torch.tensor([0.1, 0.2, 0.3]),
                                                     torch.tensor([0.0, 1.0, 2.0]), 1,
                                                     torch.quint8)]),
    }
    for name, (head, segments) in cases.items():
        write("codec", name, codec_input(head, segments))
    # The same frames with the tensor segments provided (shared slabs), and
    # a pool-sized segment received through a BufferPool.
    head, segments = cases["mixed"]
    provided = [0] + [PROVIDED] * (len(segments) - 1)
    write("codec", "mixed-provided", codec_input(head, segments, provided))
    write("codec", "payload-provided",
          codec_input(*cases["payload-only"], flags=[PROVIDED]))
    head, segments = cases["dense"]
    write("codec", "dense-pooled",
          codec_input(head, segments, [0, POOL_SIZED], use_pool=True))
    # The dense tensor's device byte (the head's last) as -2-d: host bytes
    # that land on cuda:0 ({"cpu": 0} maps; the harness has no devices).
    write("codec", "host-to-device", codec_input(head[:-1] + b"\xfe", segments))


# --- ring --------------------------------------------------------------------

# FileKind and WakeKind of shm_files.h / fuzz_ring.cpp.
FILE_SEALED, FILE_KINDS = 0, 11
WAKE_SOCKET, WAKE_KINDS = 0, 7

# Ops of fuzz_ring.cpp: op % 6, operands in the other bits.
R_CONSUME = pick(lambda o: o % 6 == 0)
R_RECORD_NEAR = pick(lambda o: o % 6 == 1 and o & 8 and o & 16 and not o & 32)
R_RECORD_RAW = pick(lambda o: o % 6 == 1 and not o & 8 and not o & 16 and o & 32)
R_SET = {f: pick(lambda o, f=f: o % 6 == 2 and (o >> 3) % 4 == f) for f in range(4)}
MAGIC, CAPACITY, CONSUMED, WAITING = range(4)
R_DATA = pick(lambda o: o % 6 == 3)
R_GROW = pick(lambda o: o % 6 == 4 and o & 8)
R_SHRINK = pick(lambda o: o % 6 == 4 and not o & 8)
R_PRODUCE = pick(lambda o: o % 6 == 5)


def ring_attach(kind=FILE_SEALED, wake=WAKE_SOCKET):
    """Attach mode: a table capacity, a file of exactly its size, a valid
    header (selectors 0 take no operands), consumed 0, writerWaiting 0."""
    return bytes([0, kind, wake, 0, 0, 0]) + u64(0) + u32(0)


def consume(n):
    return bytes([R_CONSUME]) + u16(n)


def set_field(field, v):
    return bytes([R_SET[field]]) + u64(v)


def produce(n, chunk):
    return bytes([R_PRODUCE]) + u16(n) + u16(chunk) + bytes(range(16))


def ring_seeds():
    ops = (consume(100) + consume(5000) + set_field(WAITING, 1) + consume(7)
           + bytes([R_DATA]) + u32(120) + bytes([4]) + b"abcd"
           + bytes([R_RECORD_NEAR, 0]) + u16(10)
           + set_field(MAGIC, 0) + set_field(CAPACITY, 1 << 40)
           + set_field(CONSUMED, 1 << 63) + consume(9)
           + bytes([R_RECORD_RAW]) + u64(0) + u64(1 << 62)
           + bytes([R_GROW]) + u16(4096) + bytes([R_SHRINK]) + u16(1))
    write("ring", "attach-ops", ring_attach() + ops)
    write("ring", "attach-wrap", ring_attach() + consume(65535) * 3)
    for kind in range(FILE_KINDS):
        write("ring", f"attach-kind{kind}", ring_attach(kind=kind) + consume(1))
    for wake in range(WAKE_KINDS):
        write("ring", f"attach-wake{wake}",
              ring_attach(wake=wake) + set_field(WAITING, 1) + consume(64))
    head = bytes([0, FILE_SEALED, WAKE_SOCKET, 0, 0])
    write("ring", "attach-bad-magic", head + b"\1" + u64(1) + u64(0) + u32(0))
    write("ring", "attach-short", bytes([0, FILE_SEALED, WAKE_SOCKET, 0, 1])
          + u16(1) + b"\0" + u64(0) + u32(0))
    write("ring", "attach-raw-capacity", bytes([0, FILE_SEALED, WAKE_SOCKET, 1])
          + u64(1 << 40) + b"\0\0" + u64(0) + u32(0))
    # Loopback: produce, consume what was produced, let the ring fill, then
    # the peer rewrites `consumed` to something impossible.
    loop = (bytes([1, 0]) + produce(1000, 65535) + bytes([R_CONSUME])
            + produce(65535, 4096) + produce(65535, 65535)
            + bytes([R_CONSUME]) * 2 + produce(65535, 65535) * 2
            + set_field(CONSUMED, 1 << 50) + produce(10, 10))
    write("ring", "loopback", loop)
    write("ring", "loopback-full",
          bytes([1, 0]) + produce(65535, 65535) * 3 + bytes([R_CONSUME]) * 3)


# --- slab --------------------------------------------------------------------

S_PEER_WRITE, S_OUR_WRITE, S_SHRINK, S_GROW = range(4)


def slab_seeds():
    ops = (bytes([S_PEER_WRITE]) + u32(4095) + b"\x5a"
           + bytes([S_OUR_WRITE]) + u32(0) + b"\xa5"
           + bytes([S_SHRINK]) + u16(0) + bytes([S_GROW]) + u16(4096))
    # kind, size selector (table entry), capacity selector (== size).
    for kind in range(FILE_KINDS):
        write("slab", f"kind{kind}", bytes([kind, 0, 0]) + ops)
    for entry in range(4):
        write("slab", f"size{entry}", bytes([FILE_SEALED, entry << 2, 0]) + ops)
    write("slab", "capacity-off-by-one",
          bytes([FILE_SEALED, 0, 1]) + struct.pack("<h", 1) + ops)
    write("slab", "capacity-short",
          bytes([FILE_SEALED, 1 << 2, 1]) + struct.pack("<h", -4096) + ops)
    write("slab", "capacity-zero", bytes([FILE_SEALED, 0, 2]) + u64(0))
    write("slab", "capacity-huge", bytes([FILE_SEALED, 0, 2]) + u64(1 << 63))
    write("slab", "size-raw",
          bytes([FILE_SEALED, 1]) + u32(12288) + bytes([3]) + u16(3) + ops)


# --- stream ----------------------------------------------------------------
# A setup byte (bit 0: a real ring is set up first, bit 1: a real slab, id 1;
# with the fake CUDA driver, bit 2: a cuda_ipc block, id 1, bit 3: a legacy
# one, id 2; bits 2-7: the piece size the input is fed in), then the peer's
# frames.

STREAM_RING, STREAM_SLAB = 1, 2
# The top byte of a segment length names its channel: shm_slab 1, shm_ring 2,
# cuda_staged 4 (its bytes follow in the stream).
REGION_BIT, CHUNKED_BIT, STAGED_BIT = 1 << 56, 2 << 56, 4 << 56


def message(segments, head=b"h" * 16, flags=0, lengths=None):
    lengths = lengths if lengths is not None else [len(x) for x in segments]
    data = sum(n & ((1 << 56) - 1) for n in lengths)
    return (frame_header(4, flags=flags, head=len(head), segments=len(lengths), data=data)
            + b"".join(u64(n) for n in lengths) + head + b"".join(segments))


# The shm channels' frame kinds: the registry's first and second channels
# (csrc/channel/registry.cpp) get kinds 16.. and 24.. (frame.h).
SLAB_SETUP, SLAB_RELEASE, SLAB_DROP = 16, 17, 18
RING_SETUP, RING_DROP = 24, 25
# cuda_ipc, the third: kinds 32.., segment top byte 3, records
# {uint32 id, uint32 kind, uint64 offset}; setup bits 2 and 3.
IPC_SETUP, IPC_RELEASE, IPC_DROP = 32, 33, 34
# ... and its grants (protocol 11; their slot fields, protocol 12): kinds 36
# (grant, 172 bytes) and 37 (grant event, 72 bytes), record kind 5 (granted).
IPC_GRANT, IPC_GRANT_EVENT = 36, 37
IPC_GRANTED = 5
# ... and their ends (protocol 12): kinds 38 (revoke) and 39 (returned),
# each 1 to 1024 uint32 ids.
IPC_GRANT_REVOKE, IPC_GRANT_RETURNED = 38, 39
IPC_BIT = 3 << 56
IPC_LENT, IPC_RETURNED, IPC_COPY_OUT, IPC_COPY_OUT_LAST = 1, 2, 3, 4
STREAM_IPC_FD, STREAM_IPC_LEGACY = 4, 8
IPC_BLOCK = 2 << 20  # the harness's blocks


# tcp_lanes, the fifth: kinds 48 (offer), 49 (decline, no head), segment top
# byte 5, records {uint64 token, uint64 size}.
LANES_OFFER, LANES_DECLINE = 48, 49
LANES_BIT = 5 << 56


# cuda_ring, the seventh: kinds 64 (setup), 65 (drop), segment top byte 7,
# records {uint64 generation, uint32 slot, uint32 bytes}; setup bit 4.
CUDA_RING_SETUP, CUDA_RING_DROP = 64, 65
CUDA_RING_BIT = 7 << 56
STREAM_CUDA_RING = 16


def stream_seeds():
    ping, pong = frame_header(5), frame_header(6)
    write("stream", "lanes-offer",
          bytes([0]) + frame_header(LANES_OFFER, head=36) + bytes([0x10, 0x27, 1, 0]) + bytes(32))
    write("stream", "lanes-decline", bytes([0]) + frame_header(LANES_DECLINE))
    write("stream", "lanes-decline-with-head",
          bytes([0]) + frame_header(LANES_DECLINE, head=8) + u64(7))
    write("stream", "lanes-record-held",
          bytes([0]) + message([u64(1) + u64(4096)], lengths=[4096 | LANES_BIT]) + ping)
    write("stream", "lanes-record-mismatch",
          bytes([0]) + message([u64(1) + u64(100)], lengths=[4096 | LANES_BIT]))
    write("stream", "ping-pong", bytes([0]) + ping + pong)
    write("stream", "message", bytes([0]) + message([b"a" * 100, b"", b"b" * 20000]))
    write("stream", "messages-small-pieces",
          bytes([7 << 2]) + message([b"x" * 3]) + ping + message([b"y" * 70000]))
    write("stream", "ring-drop-without-ring", bytes([0]) + frame_header(RING_DROP))
    write("stream", "slab-release-unheld", bytes([0]) + frame_header(SLAB_RELEASE, head=4) + u32(1))
    # Chunked: 70,000 bytes through the 64 KiB ring, two records.
    chunked = message([u64(0) + u64(65536) + u64(0) + u64(4464)], flags=1,
                      lengths=[70000 | CHUNKED_BIT])
    write("stream", "ring-chunks", bytes([STREAM_RING]) + chunked + frame_header(RING_DROP))
    write("stream", "ring-chunk-misplaced",
          bytes([STREAM_RING]) + message([u64(4096) + u64(100)], flags=1,
                                         lengths=[100 | CHUNKED_BIT]))
    # Region: 4096 bytes at offset 0 of the peer's slab 1 (kind 1: lent).
    region = message([b"s" * 8, u32(1) + u32(1) + u64(0)], lengths=[8, 4096 | REGION_BIT])
    write("stream", "slab-region", bytes([STREAM_SLAB]) + region + frame_header(SLAB_DROP, head=4) + u32(1))
    write("stream", "slab-overrun",
          bytes([STREAM_SLAB]) + message([u32(1) + u32(1) + u64(65536 - 8)],
                                         lengths=[4096 | REGION_BIT]))
    write("stream", "ring-and-slab",
          bytes([STREAM_RING | STREAM_SLAB]) + chunked + region + ping)
    # Staged: segment 1 lands on cuda:0 (no driver in the harness: refused),
    # segment 0 in host memory (refused before any driver call).
    write("stream", "staged-device",
          bytes([0]) + message([b"p" * 8, b"d" * 5000], lengths=[8, 5000 | STAGED_BIT]))
    write("stream", "staged-host",
          bytes([0]) + message([b"d" * 300], lengths=[300 | STAGED_BIT]) + ping)
    # cuda_ipc (channel 3, kinds 32-34; the harness has it with the fake
    # driver): segment 1 goes to cuda:0; block 1 is a descriptor block
    # (setup bit 2), block 2 a legacy one (bit 3).
    lent = message([b"p" * 8, u32(1) + u32(IPC_LENT) + u64(256)], lengths=[8, 4096 | IPC_BIT])
    write("stream", "ipc-lent", bytes([STREAM_IPC_FD]) + lent + frame_header(IPC_DROP, head=4) + u32(1))
    write("stream", "ipc-lent-overrun",
          bytes([STREAM_IPC_FD]) + message([b"p", u32(1) + u32(IPC_LENT) + u64(IPC_BLOCK - 100)],
                                           lengths=[1, 4096 | IPC_BIT]))
    copy_out = message([b"p" * 8, u32(2) + u32(IPC_COPY_OUT) + u64(0), b"q",
                        u32(2) + u32(IPC_COPY_OUT_LAST) + u64(8192)],
                       lengths=[8, 5000 | IPC_BIT, 1, 3000 | IPC_BIT])
    write("stream", "ipc-copy-out", bytes([STREAM_IPC_LEGACY]) + copy_out + ping)
    write("stream", "ipc-copy-out-unmarked",
          bytes([STREAM_IPC_LEGACY]) + message([b"p", u32(2) + u32(IPC_COPY_OUT) + u64(0)],
                                               lengths=[1, 100 | IPC_BIT]))
    write("stream", "ipc-both-returned-release",
          bytes([STREAM_IPC_FD | STREAM_IPC_LEGACY]) + lent
          + message([b"p", u32(1) + u32(IPC_RETURNED) + u64(0)], lengths=[1, 64 | IPC_BIT])
          + frame_header(IPC_RELEASE, head=8) + u32(1) + u32(2))
    # A grant whose handle does not open (ignored: by block), one past its
    # segment, a grant event that does not open, a record of a grant never
    # made (each refused).
    write("stream", "ipc-grant-unopened",
          bytes([STREAM_IPC_FD]) + frame_header(IPC_GRANT, head=172)
          + u32(1) + u32(0) + u64(4 << 20) + u64(0) + u64(1) + u64(8 << 20) + bytes(128) + u32(0)
          + ping)
    write("stream", "ipc-grant-refused",
          bytes([STREAM_IPC_FD]) + frame_header(IPC_GRANT, head=172)
          + u32(1) + u32(0) + u64(16 << 20) + u64(0) + u64(1) + u64(8 << 20) + bytes(128) + u32(1))
    write("stream", "ipc-grant-event-garbage",
          bytes([STREAM_IPC_FD]) + frame_header(IPC_GRANT_EVENT, head=72) + u32(0) + u32(0)
          + bytes(64))
    write("stream", "ipc-granted-unknown",
          bytes([STREAM_IPC_FD]) + message([b"p" * 8, u32(9) + u32(IPC_GRANTED) + u64(0)],
                                           lengths=[8, 4096 | IPC_BIT]))
    # A revoke of grants the harness never had (ignored), a return of a
    # grant never made (refused), and a return head that is no list of ids.
    write("stream", "ipc-grant-revoke",
          bytes([STREAM_IPC_FD]) + frame_header(IPC_GRANT_REVOKE, head=8) + u32(1) + u32(7) + ping)
    write("stream", "ipc-grant-returned-unknown",
          bytes([STREAM_IPC_FD]) + frame_header(IPC_GRANT_RETURNED, head=4) + u32(3))
    write("stream", "ipc-grant-returned-ragged",
          bytes([STREAM_IPC_FD]) + frame_header(IPC_GRANT_RETURNED, head=6) + u32(3) + b"xy")
    write("stream", "unknown-channel",
          bytes([STREAM_RING | STREAM_SLAB]) + message([u64(0) + u64(0)], lengths=[4096 | (9 << 56)]))
    # cuda_ring (channel 7, kinds 64-65; with the fake driver, setup bit 4:
    # a ring of 2 slots of 64 KiB, generation 1): segment 1 goes to cuda:0
    # in two chunks through slots 0 and 1, then the ring is dropped; a
    # record past its slot; a record for host memory; a setup of garbage.
    cuda_ring = message([b"p" * 8, u64(1) + u32(0) + u32(65536) + u64(1) + u32(1) + u32(4464)],
                        flags=1, lengths=[8, 70000 | CUDA_RING_BIT])
    write("stream", "cuda-ring-chunks",
          bytes([STREAM_CUDA_RING]) + cuda_ring + frame_header(CUDA_RING_DROP, head=8) + u64(1))
    write("stream", "cuda-ring-overrun",
          bytes([STREAM_CUDA_RING]) + message([b"p", u64(1) + u32(1) + u32(70000)], flags=1,
                                              lengths=[1, 70000 | CUDA_RING_BIT]))
    write("stream", "cuda-ring-host",
          bytes([STREAM_CUDA_RING]) + message([u64(1) + u32(0) + u32(100)], flags=1,
                                              lengths=[100 | CUDA_RING_BIT]) + ping)
    write("stream", "cuda-ring-eventfd-wake", bytes([32]) + ping)
    write("stream", "cuda-ring-setup-garbage",
          bytes([0]) + frame_header(CUDA_RING_SETUP, head=24) + u64(2) + u32(65) + u32(0) + u64(4096))


# --- frame_ring ------------------------------------------------------------
# fuzz_frame_ring.cpp: a setup byte (how many input bytes follow the ring's
# offer in its send), then operations, each an op byte whose low three bits
# name it and its operands.

FR_FIELD_HEAD, FR_FIELD_CARRIERS, FR_FIELD_MAGIC = 0, 4, 5
BODY_ON_SOCKET, CARRIER = 2, 4  # frame.h kFlagBodyOnSocket, kFlagCarrier


def fr_bytes(op, n, pattern):
    return bytes([op]) + u32(n) + u16(len(pattern)) + pattern


def fr_ring(data):
    """`data` written into the ring (in ops of at most 65535 bytes each)."""
    return b"".join(fr_bytes(0, len(data[i:i + 65535]), data[i:i + 65535])
                    for i in range(0, len(data), 65535))


def fr_socket(data):
    return fr_bytes(1, len(data), data)


def fr_field(f, v):
    return bytes([3, f]) + u64(v)


FR_CARRIER, FR_CARRIER_UNCOUNTED, FR_CARRIER_NO_FD = b"\x02F", b"\x0aF", b"\x12F"
FR_SIGNAL, FR_SIGNAL_FD, FR_SETTLE, FR_WAIT = b"\x04", b"\x0c", b"\x05", b"\x0d"
FR_END_SIGNAL, FR_SHUT_SOCKET = b"\x06", b"\x0e"
FR_SECOND_OFFER, FR_SLAB, FR_SHM_RING = b"\x07", b"\x0f", b"\x17"


def body_prefix(n, head=b"h" * 16, flags=BODY_ON_SOCKET, segments=None):
    """A message's header, lengths and head; its `n` bytes go elsewhere."""
    segments = segments or [n]
    return (frame_header(4, flags=flags, head=len(head), segments=len(segments), data=n)
            + b"".join(u64(x) for x in segments) + head)


def frame_ring_seeds():
    ping = frame_header(5)
    write("frame_ring", "ping", bytes([0]) + fr_ring(ping) + FR_SETTLE)
    write("frame_ring", "messages", bytes([0]) + fr_ring(
        message([b"a" * 100, b"", b"b" * 2000]) + ping + body_prefix(60000, flags=0))
        + fr_bytes(0, 60000, b"c") + FR_SETTLE)
    # A frame larger than the ring, through it in pieces.
    write("frame_ring", "message-past-the-ring",
          bytes([0]) + fr_ring(body_prefix(150000, flags=0)) + fr_bytes(0, 150000, b"d")
          + FR_SETTLE + fr_ring(ping))
    # Bodies on the socket: the prefix in the ring, the body on the socket;
    # the ring's next frame already there (kept while the body is read); two
    # segments; the body cut short by the socket's end.
    body = 70000
    write("frame_ring", "body-on-socket",
          bytes([0]) + fr_ring(body_prefix(body)) + fr_bytes(1, body, b"x") + FR_SETTLE
          + fr_ring(ping))
    write("frame_ring", "body-on-socket-ring-ahead",
          bytes([0]) + fr_ring(body_prefix(body) + ping + ping) + FR_SETTLE
          + fr_bytes(1, body, b"xy") + FR_SETTLE)
    write("frame_ring", "body-on-socket-two-segments",
          bytes([0]) + fr_ring(body_prefix(body, segments=[4096, body - 4096]))
          + fr_bytes(1, body, b"z") + fr_ring(ping) + FR_SETTLE)
    write("frame_ring", "body-on-socket-cut",
          bytes([0]) + fr_ring(body_prefix(body)) + fr_bytes(1, 1000, b"x") + FR_SHUT_SOCKET)
    # Carriers: counted and sent before their frame; read with the ring's
    # offer (setup byte 1: the carrier's byte follows the offer); a body
    # and a carrier, in frame order.
    write("frame_ring", "carrier",
          bytes([0]) + FR_CARRIER + fr_ring(frame_header(5, flags=CARRIER)) + FR_SETTLE)
    write("frame_ring", "carrier-with-the-offer",
          bytes([1]) + b"F" + fr_field(FR_FIELD_CARRIERS, 1)
          + fr_ring(frame_header(5, flags=CARRIER)) + FR_SETTLE)
    write("frame_ring", "body-then-carrier",
          bytes([0]) + fr_ring(body_prefix(body)) + fr_bytes(1, body, b"x") + FR_CARRIER
          + fr_ring(frame_header(5, flags=CARRIER) + ping) + FR_SETTLE)
    # Hostile: a carrier's flag with none counted, counted but not sent, a
    # frame's bytes where the carrier belongs; flags on frames they do not
    # belong to; impossible positions; signals with descriptors; the ring's
    # end mid-frame; a second ring.
    write("frame_ring", "carrier-uncounted",
          bytes([0]) + FR_CARRIER_UNCOUNTED + fr_ring(frame_header(5, flags=CARRIER)))
    write("frame_ring", "carrier-never-sent",
          bytes([0]) + fr_field(FR_FIELD_CARRIERS, 3) + fr_ring(frame_header(5, flags=CARRIER)))
    write("frame_ring", "frame-where-the-carrier-belongs",
          bytes([0]) + fr_socket(ping) + fr_field(FR_FIELD_CARRIERS, 1)
          + fr_ring(frame_header(5, flags=CARRIER)))
    write("frame_ring", "carrier-without-descriptors",
          bytes([0]) + FR_CARRIER_NO_FD + fr_ring(frame_header(5, flags=CARRIER) + ping))
    write("frame_ring", "body-flag-on-a-ping",
          bytes([0]) + fr_ring(frame_header(5, flags=BODY_ON_SOCKET)))
    write("frame_ring", "flags-combined",
          bytes([0]) + FR_CARRIER + fr_ring(body_prefix(100, flags=BODY_ON_SOCKET | CARRIER))
          + fr_bytes(1, 100, b"q"))
    write("frame_ring", "head-impossible",
          bytes([0]) + fr_ring(ping) + fr_field(FR_FIELD_HEAD, 1 << 40) + FR_SIGNAL)
    write("frame_ring", "magic-rewritten",
          bytes([0]) + fr_field(FR_FIELD_MAGIC, 0) + fr_ring(ping) + FR_SETTLE)
    write("frame_ring", "signal-with-descriptor",
          bytes([0]) + fr_ring(ping) + FR_SETTLE + FR_SIGNAL_FD + FR_WAIT)
    write("frame_ring", "end-mid-frame",
          bytes([0]) + fr_ring(message([b"e" * 5000])[:3000]) + FR_END_SIGNAL)
    # Records checked against real mappings: a slab's region in the ring,
    # and in a body on the socket (its 16-byte record there); a chunk
    # record of the shm_ring channel whose bytes never come.
    region = message([b"s" * 8, u32(1) + u32(1) + u64(0)], lengths=[8, 4096 | REGION_BIT])
    write("frame_ring", "slab-region", bytes([0]) + FR_SLAB + fr_ring(region + ping) + FR_SETTLE)
    write("frame_ring", "slab-region-in-a-body",
          bytes([0]) + FR_SLAB + fr_ring(body_prefix(8 + 4096, segments=[8, 4096 | REGION_BIT]))
          + fr_socket(b"s" * 8 + u32(1) + u32(1) + u64(0)) + fr_ring(ping) + FR_SETTLE)
    write("frame_ring", "slab-region-overrun-in-a-body",
          bytes([0]) + FR_SLAB + fr_ring(body_prefix(4096, segments=[4096 | REGION_BIT]))
          + fr_socket(u32(1) + u32(1) + u64(65536 - 8)) + FR_WAIT)
    write("frame_ring", "shm-ring-chunk-unproduced",
          bytes([0]) + FR_SHM_RING
          + fr_ring(message([u64(0) + u64(4096)], flags=1, lengths=[4096 | CHUNKED_BIT]))
          + FR_SETTLE)
    write("frame_ring", "second-offer", bytes([0]) + fr_ring(ping) + FR_SETTLE + FR_SECOND_OFFER)


if __name__ == "__main__":
    frame_ring_seeds()
    stream_seeds()
    frame_seeds()
    handshake_seeds()
    ring_seeds()
    slab_seeds()
    codec_seeds()
    for target in sorted(os.listdir(CORPUS)):
        files = os.listdir(os.path.join(CORPUS, target))
        size = sum(os.path.getsize(os.path.join(CORPUS, target, f)) for f in files)
        print(f"{target}: {len(files)} files, {size} bytes")
