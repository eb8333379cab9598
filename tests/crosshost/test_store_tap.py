# SPDX-License-Identifier: BSD-3-Clause
"""A tap on the network records the rendezvous store's traffic while a
group starts, then tries to join with what it saw (issue 45, finding 1).

Two hosts (network namespaces, netns.py) and the bridge between them in a
third namespace, where the tap runs: an AF_PACKET socket on the bridge's
port to host 1 (where rank 1's store client talks to the store on host 0)
that keeps every TCP payload to or from the store's port, both ways
(TCPStore is plain TCP). The group has no secret of its own and runs in the clear
(``encryption="off"``, so that the attacker can speak our handshake without
TLS). Every 32-byte value the store carried (TCPStore sends a value as a
u64 length, then its bytes) is tried as the group secret in a handshake
with worker1 from host 0: none may succeed. Before the secret was sealed,
rank 0 wrote it under ``torch_rpc_ext/secret`` and the tap had it."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORT = 29500

TAP = r"""
import os, signal, socket, struct, sys
dev, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))  # ETH_P_ALL
s.bind((dev, 0))
s.settimeout(0.2)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print("ready", flush=True)
with open(out, "wb") as f:
    while not stop:
        try:
            frame = s.recv(65536)
        except socket.timeout:
            continue
        if len(frame) < 54 or frame[12:14] != b"\x08\x00":
            continue
        ip = frame[14:]
        ihl = (ip[0] & 15) * 4
        if ip[9] != 6:  # TCP
            continue
        tcp = ip[ihl:]
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        payload = tcp[(tcp[12] >> 4) * 4:]
        if payload and port in (sport, dport):
            f.write(struct.pack("<HHII", sport, dport, seq, len(payload)) + payload)
"""

WORKER = r"""
import json, os, sys
import torch.distributed.rpc as rpc
import torch_rpc_ext
rank, master, me = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR=master, MASTER_PORT=sys.argv[4])
opts = torch_rpc_ext.RpcExtBackendOptions(rpc_timeout=60, address=me, transports=["tcp"],
                                          encryption="off")
rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
             backend=rpc.BackendType.TORCH_RPC_EXT, rpc_backend_options=opts)
print(json.dumps(rpc.api._get_current_rpc_agent().address), flush=True)
sys.stdin.readline()  # until the attacker is done
rpc.shutdown()
"""

ATTACKER = r"""
import json, sys, time
from torch_rpc_ext.testing import handshake
address = sys.argv[1]
candidates = [bytes.fromhex(h) for h in json.load(open(sys.argv[2]))]
admitted = 0
for i, c in enumerate(candidates):
    if i and len(candidates) > 7:
        time.sleep(1.5)  # fewer than 8 refused proofs in 10 s: not held off
    sock, ok = handshake(address, c, client_id=0, stretch=False)
    sock.close()
    admitted += ok
print(json.dumps({"tried": len(candidates), "admitted": admitted}), flush=True)
"""


def flows(capture: bytes) -> dict:
    """The recorded payloads, put back in order per direction: (sport,
    dport) -> bytes (retransmissions counted once)."""
    segments = {}
    at = 0
    while at + 12 <= len(capture):
        sport, dport, seq, n = struct.unpack_from("<HHII", capture, at)
        segments.setdefault((sport, dport), {})[seq] = capture[at + 12:at + 12 + n]
        at += 12 + n
    return {k: b"".join(v[s] for s in sorted(v)) for k, v in segments.items()}


def values_of_32_bytes(stream: bytes) -> set:
    """Every 32-byte run that follows a u64 length of 32, as TCPStore sends
    a value (keys too: a few candidates more or less change nothing)."""
    mark = struct.pack("<Q", 32)
    out, at = set(), stream.find(mark)
    while at >= 0:
        if at + 8 + 32 <= len(stream):
            out.add(stream[at + 8:at + 40])
        at = stream.find(mark, at + 1)
    return out


@pytest.mark.timeout(300)
def test_a_tap_on_the_store_at_start_up_cannot_join_the_group(two_hosts, tmp_path):
    hosts = two_hosts
    capture = tmp_path / "store.cap"
    tap = subprocess.Popen(
        ["ip", "netns", "exec", hosts.bridge_ns, sys.executable, "-c", TAP, hosts.port(1),
         str(PORT), str(capture)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        assert tap.stdout.readline().strip() == "ready", tap.stderr.read()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        for env_key in ("TORCH_RPC_EXT_SECRET", "TORCH_RPC_EXT_TRANSPORTS", "TORCH_RPC_EXT_ADDR"):
            env.pop(env_key, None)
        for rank in range(2):
            workers.append(hosts.run(
                rank, [sys.executable, "-c", WORKER, str(rank), hosts.ipv4(0), hosts.ipv4(rank),
                       str(PORT)],
                timeout=240, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))
        addresses = [json.loads(w.stdout.readline() or "null") for w in workers]
        assert all(addresses), [w.stderr.read()[-2000:] for w in workers]
        time.sleep(0.5)  # the tap's last segments
        tap.send_signal(signal.SIGTERM)
        tap.wait(30)
        recorded = flows(capture.read_bytes())
        assert recorded, "the tap saw no store traffic"
        candidates = set()
        for stream in recorded.values():
            candidates |= values_of_32_bytes(stream)
        # At least the two public keys crossed: the tap and the parser work.
        assert len(candidates) >= 2, len(candidates)
        (tmp_path / "candidates.json").write_text(json.dumps(sorted(c.hex() for c in candidates)))
        attacker = hosts.execute(
            0, ["env", f"PYTHONPATH={ROOT}", sys.executable, "-c", ATTACKER, addresses[1],
                str(tmp_path / "candidates.json")],
            timeout=120)
        got = json.loads(attacker.stdout.strip().splitlines()[-1])
        assert got["tried"] == len(candidates)
        assert got["admitted"] == 0, got
        for w in workers:
            w.stdin.write("\n")
            w.stdin.flush()
        for w in workers:
            assert w.wait(60) == 0, w.stderr.read()[-2000:]
    finally:
        if tap.poll() is None:
            tap.kill()
        for w in workers:
            if w.poll() is None:
                w.kill()
