# SPDX-License-Identifier: BSD-3-Clause
"""The rendezvous store is unauthenticated (issue 45): what a worker reads
there is never unpickled, and a malformed record fails init_rpc naming it."""

import datetime
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from tests.rpc.world import free_port
from torch_rpc_ext import store_records
from torch_rpc_ext.testing import handshake

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _SetsAFlag:
    """What an attacker would put in the store: unpickling it runs code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


WORKER = """
    import os, sys
    import torch.distributed.rpc as rpc
    import torch_rpc_ext
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    opts = torch_rpc_ext.RpcExtBackendOptions(rpc_timeout=20, address="127.0.0.1")
    try:
        rpc.init_rpc("worker0", rank=0, world_size=2,
                     backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)
    except Exception as e:
        print("REFUSED", type(e).__name__, e, flush=True)
        sys.exit(0)
    print("JOINED", flush=True)
    sys.exit(1)
"""


def _store_client(port: int, deadline: float) -> dist.TCPStore:
    while True:
        try:
            # As a second rank would: rank 0's store waits for 2 clients.
            return dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                                 timeout=datetime.timedelta(seconds=5))
        except Exception:  # noqa: BLE001 - the worker's store is not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("record", ["pickle", "garbage"])
def test_a_record_written_by_someone_else_is_refused_and_never_unpickled(tmp_path, record):
    """Rank 1's device record, written by an attacker who reached the store:
    a pickle whose loading would create a file, or bytes that are not ours.
    The worker refuses to start, naming rank 1 and the key; no file."""
    port = free_port()
    flag = tmp_path / "flag"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WORKER), str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        store = _store_client(port, time.monotonic() + 60)
        value = pickle.dumps(_SetsAFlag(str(flag))) if record == "pickle" else b"\x80junk"
        store.set("rpc_prefix_0/torch_rpc_ext/devices/1", value)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not flag.exists()
    assert "REFUSED ValueError" in out, (out, err[-2000:])
    assert "rank 1's record under 'torch_rpc_ext/devices/1'" in out
    assert "rendezvous store is malformed" in out


def test_records_round_trip():
    cuda0, cuda1 = torch.device("cuda:0"), torch.device("cuda:1")
    raw = store_records.encode_devices(
        "worker0", {"worker1": {cuda0: cuda1, torch.device("cpu"): cuda0}}, [cuda0])
    assert store_records.decode_devices(raw, 0, "k") == (
        "worker0", {"worker1": {cuda0: cuda1, torch.device("cpu"): cuda0}}, [cuda0])
    assert store_records.decode_devices(
        store_records.encode_devices("w", {}, []), 0, "k") == ("w", {}, [])
    assert store_records.decode_count(store_records.encode_count(8), 3, "k") == 8


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"", "not JSON"),
        (b"[]", "a JSON list"),
        (json.dumps({"v": 2, "count": 1}).encode(), "version 2"),
        (json.dumps({"v": 1, "count": 1, "x": 0}).encode(), "fields"),
        (json.dumps({"v": 1, "count": -1}).encode(), "count -1"),
        (json.dumps({"v": 1, "count": True}).encode(), "count True"),
        (json.dumps({"v": 1, "count": 1.0}).encode(), "count 1.0"),
        (b"[" * 100000, "not JSON"),
        (b" " * (store_records.MAX_RECORD_BYTES + 1), "more than"),
    ],
)
def test_a_malformed_count_is_refused_naming_why(raw, why):
    with pytest.raises(ValueError, match="rank 3's record under 'key'") as e:
        store_records.decode_count(raw, 3, "key")
    assert why in str(e.value)


@pytest.mark.parametrize(
    "record, why",
    [
        ({"name": "bad/name", "maps": {}, "devices": []}, "not a worker name"),
        ({"name": "w", "maps": {"p": {"cuda:0": "tpu:0"}}, "devices": []}, "not cpu or cuda"),
        ({"name": "w", "maps": {"p": {"cuda": "cuda:0"}}, "devices": []}, "not cpu or cuda"),
        ({"name": "w", "maps": {"p": []}, "devices": []}, "not an object of devices"),
        ({"name": "w", "maps": [], "devices": []}, "maps is not"),
        ({"name": "w", "maps": {}, "devices": "cuda:0"}, "devices is not"),
        ({"name": "w", "maps": {}, "devices": [0]}, "device '0'"),
        ({"name": "w", "maps": {"x" * 2000: {}}, "devices": []}, "peer"),
    ],
)
def test_a_malformed_device_record_is_refused_naming_why(record, why):
    raw = json.dumps({"v": 1, **record}).encode()
    with pytest.raises(ValueError) as e:
        store_records.decode_devices(raw, 1, "key")
    assert why in str(e.value)


def test_random_bytes_and_mutations_only_ever_raise_value_error():
    """A small fuzz of both decoders: every input decodes or raises
    ValueError (nothing else escapes, nothing hangs)."""
    rng = random.Random(45)
    seeds = [
        store_records.encode_devices("worker0", {"worker1": {torch.device("cuda:0"):
                                                             torch.device("cuda:1")}},
                                     [torch.device("cuda:0")]),
        store_records.encode_count(2),
    ]
    for _ in range(3000):
        raw = bytearray(rng.choice(seeds))
        for _op in range(rng.randint(1, 6)):
            op = rng.randrange(3)
            at = rng.randrange(len(raw) + 1)
            if op == 0 and raw:
                raw[min(at, len(raw) - 1)] = rng.randrange(256)
            elif op == 1:
                raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            elif raw:
                del raw[at:at + rng.randint(1, 8)]
        for decode in (store_records.decode_devices, store_records.decode_count):
            try:
                decode(bytes(raw), 0, "k")
            except ValueError:
                pass


READER_GROUP = """
    import json, os, sys
    import torch
    import torch.distributed.rpc as rpc
    import torch_rpc_ext
    rank = int(sys.argv[2])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    opts = torch_rpc_ext.RpcExtBackendOptions(rpc_timeout=30, address="127.0.0.1",
                                              transports=["tcp"], encryption="off")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)
    if rank == 0:
        print(json.dumps(rpc.api._get_current_rpc_agent().address), flush=True)
        sys.stdin.readline()  # until the reader is done
    rpc.shutdown()
"""


@pytest.mark.timeout(180)
def test_a_store_reader_learns_no_secret_that_lets_it_in():
    """A group with no secret of its own, and someone who reads everything
    the group wrote to the store (as a wire reader of the store's plain TCP
    traffic could): there is no secret in it, and nothing read there opens a
    handshake with a worker. (Before: rank 0 wrote the secret itself under
    torch_rpc_ext/secret, and the reader got in with it.)"""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(READER_GROUP), str(port), str(rank)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": ROOT},
        )
        for rank in range(2)
    ]
    try:
        address = json.loads(procs[0].stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))
        prefix = "rpc_prefix_0/torch_rpc_ext/"
        if store.check([prefix + "secret"]):  # how it was before
            leaked = store.get(prefix + "secret")
            sock, ok = handshake(address, leaked, client_id=1, stretch=False)
            sock.close()
            assert not ok, "the secret in the store let its reader in"
        read = [store.get(prefix + k) for k in (
            "secret_pub/0", "secret_pub/1", "secret_sealed/1")]
        assert [len(v) for v in read] == [32, 32, 48]
        for candidate in read + [v[:32] for v in read]:
            sock, ok = handshake(address, candidate, client_id=1, stretch=False)
            assert not ok
            sock.close()
        procs[0].stdin.write("\n")
        procs[0].stdin.flush()
        for p in procs:
            assert p.wait(60) == 0, p.stderr.read()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
