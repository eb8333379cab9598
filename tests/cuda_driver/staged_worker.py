# SPDX-License-Identifier: BSD-3-Clause
"""The two ends of a cuda_staged connection with no agent above it
(_testing.Endpoint over TCP: staging needs no shared host), each in a
spawned process that loads the driver under test; as ipc_worker.py, whose
End they use."""

import os
import time

from tests.cuda_driver.ipc_worker import End, pattern

CHANNELS = ("cuda_staged",)
CHUNK = 4 << 20  # kStagedChunkBytes
# Three chunks and a tail, one chunk exactly, small, one byte.
SIZES = (2 * CHUNK + 5, CHUNK, 5000, 1)
ROUNDS = 3


def end(role: str, conn) -> End:
    return End(role, conn, channels=CHANNELS, transport="tcp")


# ---- roundtrip: each size out and back, three times (pooled after the first) -


def roundtrip_sender(conn, ctl):
    e = end("sender", conn)
    back = []
    pinned = []
    for rnd in range(ROUNDS):
        for i, n in enumerate(SIZES):
            p = e.alloc(pattern(n, i + rnd))
            e.send_device(b"m%d" % i, p, n)
            head, (region,) = e.receive()  # the receiver sent it back
            back.append((head, region.size, e.read_region(region) == pattern(n, i + rnd)))
            region.release()
        pinned.append(e.counters("cuda_staged")["pinned_bytes"])
    e.ep.send(b"done", [])  # all came back: the receiver may close
    ctl.send((back, pinned, e.counters("cuda_staged")))
    e.close()


def roundtrip_receiver(conn, ctl):
    e = end("receiver", conn)
    seen = []
    for rnd in range(ROUNDS):
        for i, n in enumerate(SIZES):
            head, (region,) = e.receive()
            seen.append((head, region.size, region.device,
                         e.read_region(region) == pattern(n, i + rnd)))
            # Straight back from the received device memory.
            e.send_device(b"back%d" % i, region.address, region.size)
            del region
    # A staged frame is written once its copies out have completed: stay
    # until the sender has them all.
    assert e.receive()[0] == b"done"
    ctl.send((seen, e.counters("cuda_staged")))
    e.close()


# ---- mixed: host and device segments in one frame ---------------------------


def mixed_sender(conn, ctl):
    e = end("sender", conn)
    host = pattern(70000, 9)
    p = e.alloc(pattern(CHUNK + 7, 8))
    import ctypes

    buf = ctypes.create_string_buffer(host, len(host))
    e.ep.send(b"mix", [(ctypes.addressof(buf), len(host), 0, -1, 0),
                       (p, CHUNK + 7, 1, 0, e.stream)], [])
    e.receive()
    ctl.send("sent")
    e.close()


def mixed_receiver(conn, ctl):
    e = end("receiver", conn)
    head, (host, region) = e.receive()
    ok = (bytes(host) == pattern(70000, 9),
          e.read_region(region) == pattern(CHUNK + 7, 8))
    region.release()
    e.ep.send(b"ok", [])
    ctl.send((head, ok))
    e.close()


# ---- host landing: a staged segment for a tensor kept in host memory --------


def hostlanding_sender(conn, ctl):
    e = end("sender", conn)
    p = e.alloc(pattern(4096, 1))
    e.send_device(b"x", p, 4096)
    got = e.ep.receive(30)  # nothing: the receiver closes the connection
    ctl.send((got, e.ep.close_reason()))
    e.close()


def hostlanding_receiver(conn, ctl):
    e = end("receiver", conn)
    e.ep.set_landing_device(-1)
    got = e.ep.receive(30)
    ctl.send((got, e.ep.close_reason()))
    e.close()


# ---- early: a device segment sent while our connect completes ---------------


def early_sender(conn, ctl):
    # Our loop stalls 1 s before it starts the connection; the segment's
    # copy out ends meanwhile (test_staged_channel.py).
    os.environ["TORCH_RPC_EXT_TEST_PAUSE_CONNECTING_MS"] = "1000"

    def send(e):
        time.sleep(0.3)
        e.send_device(b"early", e.alloc(pattern(5000, 3)), 5000)

    e = End("sender", conn, channels=CHANNELS, transport="tcp", early=send)
    del os.environ["TORCH_RPC_EXT_TEST_PAUSE_CONNECTING_MS"]
    assert e.receive()[0] == b"ok"
    ctl.send("sent")
    e.close()


def early_receiver(conn, ctl):
    e = end("receiver", conn)
    head, (region,) = e.receive()
    ok = e.read_region(region) == pattern(5000, 3)
    region.release()
    e.ep.send(b"ok", [])
    ctl.send((head, ok))
    e.close()


def run(role: str, conn, ctl, scenario: str) -> None:
    globals()[f"{scenario}_{role}"](conn, ctl)


if __name__ == "__main__":  # pragma: no cover - used by spawn only
    os._exit(1)
