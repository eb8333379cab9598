# SPDX-License-Identifier: BSD-3-Clause
"""TLS 1.3 on TCP connections (docs/security.md, "Encryption in transit"),
driven through init_rpc: the whole API over an encrypted connection keyed
from the group secret, mutual TLS with certificates, what "auto" leaves in
the clear, and the errors when two workers disagree or a certificate is
not trusted. One host, loopback, `encryption="always"` (what "auto" does
for a peer on another host: tests/crosshost runs that across network
namespaces). The wire itself (tampering, a wrong key) is in
tests/rpc/test_tls_wire.py."""

import multiprocessing
import os
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch.distributed import rpc

from tests.rpc.world import init, run_world

pytestmark = pytest.mark.timeout(240)

PSK = "TLSv1.3 TLS_AES_128_GCM_SHA256, pre-shared key from the group secret (CPace)"


def _remote_square(t):
    return t * t


def _calls(rank, world_size, **kwargs):
    init(rank, world_size, transports=["tcp"], **kwargs)
    out = {}
    if rank == 0:
        out["add"] = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist()
        # Larger than a socket buffer: TLS records the socket takes in part.
        big = torch.arange(6_000_000, dtype=torch.float32)
        out["big"] = bool(torch.equal(rpc.rpc_sync("worker1", torch.neg, args=(big,)), -big))
        futs = [rpc.rpc_async("worker1", torch.mul, args=(torch.full((500,), i), 2)) for i in range(100)]
        out["pipelined"] = all(bool((f.wait() == 2 * i).all()) for i, f in enumerate(futs))
        rref = rpc.remote("worker1", torch.add, args=(torch.ones(3), 1))
        out["rref"] = rref.to_here().tolist()
        with dist_autograd.context() as ctx:
            x = torch.tensor([3.0], requires_grad=True)
            y = rpc.rpc_sync("worker1", _remote_square, args=(x,))
            dist_autograd.backward(ctx, [y.sum()])
            out["grad"] = dist_autograd.get_gradients(ctx)[x].tolist()
        out["info"] = rpc.api._get_current_rpc_agent().get_debug_info()
    rpc.shutdown()
    return out


def test_the_rpc_api_runs_over_tls_keyed_from_the_group_secret():
    out = run_world(_calls, 2, timeout=180, encryption="always")[0]
    assert out["add"] == [2.0, 2.0]
    assert out["big"] and out["pipelined"]
    assert out["rref"] == [2.0, 2.0, 2.0]
    assert out["grad"] == [6.0]
    info = out["info"]
    assert info["rpc_ext.encryption"] == "always"
    assert info["rpc_ext.peer.worker1.security"] == PSK
    assert info["rpc_ext.peer.worker1.transport"] == "tcp"
    # Connection events: TLS handshakes done (this end of each), none failed.
    assert int(info["rpc_ext.tcp.tls_handshakes"]) >= 1
    assert info["rpc_ext.tcp.tls_handshake_failures"] == "0"


def _key_updates():
    return int(rpc.api._get_current_rpc_agent().get_metrics()["rpc_ext.tcp.tls_key_updates"])


def _volume(rank, world_size):
    # Channels named, so that the bytes go through the TLS stream (left at
    # their default, encrypted connections stripe large tensors over lanes,
    # whose keys change by their own count: test_lanes.py).
    init(rank, world_size, transports=["tcp"], encryption="always",
         channels=["shm_slab", "shm_ring"])
    out = None
    if rank == 0:
        big = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB each way
        ok = all(bool(torch.equal(rpc.rpc_sync("worker1", torch.neg, args=(big,)), -big)) for _ in range(2))
        out = ok, _key_updates(), rpc.rpc_sync("worker1", _key_updates)
    rpc.shutdown()
    return out


def test_tls_sessions_take_fresh_keys_by_volume(monkeypatch):
    """A KeyUpdate (both ways) after every TORCH_RPC_EXT_TLS_KEY_UPDATE_BYTES
    sent (32 GiB by default; 1 MiB here): 32 MiB each way, and every byte
    arrives right across the changes of key."""
    monkeypatch.setenv("TORCH_RPC_EXT_TLS_KEY_UPDATE_BYTES", str(1 << 20))
    ok, ours, theirs = run_world(_volume, 2, timeout=180)[0]
    assert ok
    assert ours >= 30 and theirs >= 30, (ours, theirs)


def _security(rank, world_size, **kwargs):
    init(rank, world_size, **kwargs)
    if rank == 0:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
        info = rpc.api._get_current_rpc_agent().get_debug_info()
    rpc.shutdown()
    return info if rank == 0 else None


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"transports": ["tcp"]}, "none (loopback)"),
        ({"transports": ["tcp"], "encryption": "off"}, "none (encryption off)"),
        ({"encryption": "always"}, "none (shm: one host)"),
    ],
    ids=["auto-loopback", "off", "shm"],
)
def test_what_stays_in_the_clear(kwargs, expected):
    """"auto" encrypts peers off this host only; shm (one kernel) never."""
    info = run_world(_security, 2, timeout=120, **kwargs)[0]
    assert info["rpc_ext.peer.worker1.security"] == expected
    assert info["rpc_ext.peer.worker0.security"] == "none (self: no connection)"


def _mismatch(rank, world_size, both_failed):
    init(rank, world_size, transports=["tcp"], rpc_timeout=20,
         encryption="always" if rank == 0 else "off")
    try:
        rpc.rpc_sync(f"worker{1 - rank}", torch.add, args=(torch.ones(1), 1))
        error = None
    except RuntimeError as e:
        error = str(e)
    # Both listeners up until both calls have failed: a worker that left
    # early refused the other's connect outright ("Connection refused").
    both_failed.wait(60)
    rpc.shutdown(graceful=False)
    return error


def test_workers_that_disagree_on_encryption_fail_naming_it():
    both_failed = multiprocessing.get_context("fork").Barrier(2)
    errors = run_world(_mismatch, 2, timeout=120, both_failed=both_failed)
    # worker0 encrypts, worker1 has encryption off: each refuses the other's
    # connection, saying why in its log, and each caller's error names it.
    # (An end with encryption on takes TLS from any peer: "auto" and
    # "always" differ only in what they send and what clear text they take.)
    assert "during the TLS handshake (does the peer have encryption off?" in errors[0], errors
    assert "refused us: a different secret or `encryption` setting?" in errors[1], errors


# ---- mutual TLS --------------------------------------------------------------


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(d: Path, name: str):
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=d)


def _make_cert(d: Path, ca: str, name: str, san: str | None = None) -> tuple[str, str]:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    ext = []
    if san:
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        ext = ["-extfile", f"{name}.ext"]
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *ext, cwd=d)
    return str(d / f"{name}.pem"), str(d / f"{name}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a certificate per worker, and a certificate from a CA
    nobody trusts."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "rogue-ca")
    return {
        "ca": str(d / "ca.pem"),
        "worker0": _make_cert(d, "ca", "worker0", "URI:spiffe://rpc.test/worker0,DNS:worker0.rpc.test"),
        "worker1": _make_cert(d, "ca", "worker1", "URI:spiffe://rpc.test/worker1,DNS:worker1.rpc.test"),
        # Signed by the same CA, for another service.
        "intruder": _make_cert(d, "ca", "intruder", "URI:spiffe://rpc.test/billing,DNS:billing.rpc.test"),
        "rogue": _make_cert(d, "rogue-ca", "rogue"),
    }


def _mutual(rank, world_size, files, trusted=True, peer_names=None):
    cert, key, ca = files[rank]
    init(rank, world_size, transports=["tcp"], encryption="always", rpc_timeout=20,
         tls_cert=cert, tls_key=key, tls_ca=ca, tls_peer_names=peer_names)
    out = {}
    if rank == 0:
        try:
            big = torch.arange(1_000_000, dtype=torch.float32)
            out["ok"] = bool(torch.equal(rpc.rpc_sync("worker1", torch.neg, args=(big,)), -big))
            info = rpc.api._get_current_rpc_agent().get_debug_info()
            out["security"] = info["rpc_ext.peer.worker1.security"]
            out["encryption"] = info["rpc_ext.encryption"]
        except RuntimeError as e:
            out["error"] = str(e)
    if trusted:
        rpc.shutdown()
        return out
    # The two cannot talk, so neither can a graceful shutdown: worker1 waits
    # in the rendezvous store for worker0 to be done.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    if rank == 0:
        store.set("done", "1")
        store.wait(["ack"])
    else:
        store.wait(["done"])
        store.set("ack", "1")
    rpc.shutdown(graceful=False)
    return out


def test_mutual_tls_with_certificates_from_one_ca(pki):
    files = {r: (*pki[f"worker{r}"], pki["ca"]) for r in (0, 1)}
    out = run_world(_mutual, 2, timeout=120, files=files)[0]
    assert out.get("ok"), out
    assert out["encryption"] == "always (mutual TLS)"
    assert out["security"].startswith("TLSv1.3 TLS_"), out
    assert out["security"].endswith("peer certificate /CN=worker1"), out


def test_mutual_tls_refuses_a_certificate_its_ca_did_not_sign(pki):
    files = {0: (*pki["worker0"], pki["ca"]), 1: (*pki["rogue"], pki["ca"])}
    out = run_world(_mutual, 2, timeout=120, files=files, trusted=False)[0]
    assert "error" in out, out
    assert "TLS handshake" in out["error"], out


WORKERS = ("spiffe://rpc.test/worker*",)


def test_tls_peer_names_admit_the_certificates_they_name(pki):
    files = {r: (*pki[f"worker{r}"], pki["ca"]) for r in (0, 1)}
    out = run_world(_mutual, 2, timeout=120, files=files, peer_names=WORKERS)[0]
    assert out.get("ok"), out
    # A DNS name matches as well as a URI.
    out = run_world(_mutual, 2, timeout=120, files=files, peer_names=("*.rpc.test",))[0]
    assert out.get("ok"), out


def test_tls_peer_names_refuse_a_certificate_from_the_same_ca_for_someone_else(pki):
    """The CA signs certificates for other services too: without
    tls_peer_names any of them passes (as the mutual-TLS relay test shows);
    with them, worker0 refuses billing's certificate naming what it saw."""
    files = {0: (*pki["worker0"], pki["ca"]), 1: (*pki["intruder"], pki["ca"])}
    out = run_world(_mutual, 2, timeout=120, files=files)[0]
    assert out.get("ok"), out  # the CA alone admits it
    out = run_world(_mutual, 2, timeout=120, files=files, trusted=False, peer_names=WORKERS)[0]
    assert "error" in out, out
    assert ("the peer's certificate (names: URI:spiffe://rpc.test/billing, DNS:billing.rpc.test) "
            "matches none of tls_peer_names (spiffe://rpc.test/worker*)") in out["error"], out


def test_tls_peer_names_are_checked_when_options_are_made(pki, monkeypatch):
    from torch_rpc_ext import RpcExtBackendOptions

    with pytest.raises(ValueError, match="tls_peer_names needs mutual TLS"):
        RpcExtBackendOptions(tls_peer_names=WORKERS)
    with pytest.raises(ValueError, match="sequence of patterns"):
        RpcExtBackendOptions(tls_peer_names="spiffe://x/*")
    cert, key = pki["worker0"]
    with pytest.raises(ValueError, match="is not a name pattern"):
        RpcExtBackendOptions(tls_cert=cert, tls_key=key, tls_ca=pki["ca"], tls_peer_names=("",))
    monkeypatch.setenv("TORCH_RPC_EXT_TLS_PEER_NAMES", "a.example, spiffe://x/*")
    o = RpcExtBackendOptions(tls_cert=cert, tls_key=key, tls_ca=pki["ca"])
    assert o.tls_peer_names == ("a.example", "spiffe://x/*")
