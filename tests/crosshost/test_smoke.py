# SPDX-License-Identifier: BSD-3-Clause
"""Four workers on two hosts (network namespaces joined by a bridge,
netns.py): workers 0 and 1 on host 0, workers 2 and 3 on host 1, rendezvous
on host 0's address; all of IPv4, or all of IPv6 (the hosts' ULA addresses).
Worker 0 makes the public calls across the hosts (a builtin, a Python
function, an RRef, distributed autograd, a RemoteModule), and every pair of
workers connects: workers of one host must use `shm`, workers of different
hosts `tcp`. This is the test where the agent meets separate network stacks
rather than loopback. Needs root and iproute2; skips otherwise.

``OPTIONS`` lists the extra RpcExtBackendOptions keywords each run passes to
every worker (tests/crosshost/worker.py reads them as JSON)."""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORT = "29500"  # each run has fresh namespaces: nothing else listens there
WORLD_SIZE = 4
DEADLINE_S = 360  # init takes 10-20 s per worker on a busy two-core machine

# The default encrypts across hosts ("auto": the peers' addresses are not
# loopback); "clear" turns it off.
OPTIONS = {"default": {}, "clear": {"encryption": "off"}}
PSK = "TLSv1.3 TLS_AES_128_GCM_SHA256, pre-shared key from the group secret (CPace)"


def addresses(hosts, family):
    """(the rendezvous address, host index -> the agents' address) for a
    family: "ipv4", "ipv6" (ULA), "link_local" (each host's fe80:: address
    with its own interface as the scope; the store stays on IPv4), or
    "mixed" (host 0 IPv4, host 1 IPv6)."""
    if family == "link_local":
        return hosts.ipv4(0), lambda i: hosts.link_local(i, via=i)
    if family == "mixed":
        return hosts.ipv4(0), lambda i: hosts.ipv4(i) if i == 0 else hosts.ipv6(i)
    return getattr(hosts, family)(0), getattr(hosts, family)


def run_world(hosts, tmp_path, extra, family="ipv4", must_succeed=True):
    """Start the four workers (two per host) on the addresses of `family`
    (addresses()), wait for all, return their RESULT objects by rank; fail
    with their errors if one did not finish (unless not `must_succeed`)."""
    master, address = addresses(hosts, family)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_RPC_EXT_TRANSPORTS", "TORCH_RPC_EXT_ADDR",
                        "TORCH_RPC_EXT_SOCKET_IFNAME")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs, logs = [], []
    for rank in range(WORLD_SIZE):
        host = rank // 2
        out, err = tmp_path / f"worker{rank}.out", tmp_path / f"worker{rank}.err"
        logs.append((out, err))
        argv = [sys.executable, "-m", "tests.crosshost.worker", str(rank), str(WORLD_SIZE),
                master, PORT, address(host), json.dumps(extra)]
        with open(out, "w") as o, open(err, "w") as e:
            procs.append(hosts.run(host, argv, timeout=DEADLINE_S + 30, stdout=o, stderr=e,
                                   env=env, cwd=ROOT))
    # Until all have exited, one has failed (the others would then wait for
    # it, in init or in shutdown, until rpc_timeout) or the deadline passed.
    deadline = time.monotonic() + DEADLINE_S
    codes = {}
    while time.monotonic() < deadline:
        codes = {rank: p.poll() for rank, p in enumerate(procs)}
        if all(c is not None for c in codes.values()) or any(c for c in codes.values()):
            break
        time.sleep(0.2)
    results, report = {}, []
    for rank, (out, err) in enumerate(logs):
        lines = [ln for ln in out.read_text().splitlines() if ln.startswith("RESULT ")]
        if lines:
            results[rank] = json.loads(lines[-1][len("RESULT "):])
        report.append(f"--- worker{rank} exit {codes.get(rank)}\n"
                      f"{results.get(rank, {}).get('error', '')}{err.read_text()[-3000:]}")
    if must_succeed:
        assert all(codes.get(r) == 0 for r in range(WORLD_SIZE)), "\n".join(report)
    return results


@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.parametrize("extra", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize("family", ["ipv4", "ipv6", "link_local"])
def test_public_calls_across_two_hosts(two_hosts, tmp_path, extra, family):
    if family == "link_local" and extra:
        pytest.skip("link-local runs with the default options only")
    security = "none (encryption off)" if extra.get("encryption") == "off" else PSK
    check_public_calls(two_hosts, tmp_path, extra, family, security)


@pytest.mark.timeout(DEADLINE_S + 60)
def test_mutual_tls_across_two_hosts(two_hosts, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    from tests.rpc.test_tls import _make_ca, _make_cert

    _make_ca(tmp_path, "ca")
    # One certificate for the job (a site may as well issue one per host).
    cert, key = _make_cert(tmp_path, "ca", "rpc-job")
    extra = {"tls_cert": cert, "tls_key": key, "tls_ca": str(tmp_path / "ca.pem")}
    check_public_calls(two_hosts, tmp_path, extra, "ipv4", "peer certificate /CN=rpc-job")


def check_public_calls(hosts, tmp_path, extra, family, security):
    """The four workers' calls, and `security` (the whole text, or its end)
    on every connection across the hosts."""
    res = run_world(hosts, tmp_path, extra, family)
    r = res[0]
    assert "error" not in r, r["error"]
    # "host:port" (IPv6 in brackets): the address the agent listens on.
    assert r["address"].rsplit(":", 1)[0].strip("[]") == addresses(hosts, family)[1](0), r["address"]
    assert r["builtin"] == [[3.0] * 3] * 2
    assert r["python_remote"]["name"] == "worker2" and r["python_remote"]["value"] == 42
    assert r["python_local"]["name"] == "worker1"
    # Worker 2 really is on another network stack, worker 1 on ours.
    assert r["python_remote"]["netns"] != r["netns"]
    assert r["python_local"]["netns"] == r["netns"]
    assert r["rref_owner"] == "worker3" and r["rref"] == [[2.0] * 3] * 2
    assert r["grad_count"] >= 1
    assert r["grad"] is not None  # the gradient of w itself, 6 w
    for got, want in zip(r["grad"], r["grad_expected"]):
        assert got == pytest.approx(want, rel=1e-5)
    assert r["remote_module_owner"] == "worker2"
    assert r["remote_module_max_error"] < 1e-5
    # shm between the workers of a host, tcp across hosts, seen from both ends.
    for me in range(WORLD_SIZE):
        for peer in range(WORLD_SIZE):
            if peer == me:
                continue
            want = "shm" if me // 2 == peer // 2 else "tcp"
            seen = r["transports"][f"worker{me}"]
            key = f"rpc_ext.peer.worker{peer}"
            assert seen[key + ".transport"] == want, (me, peer, seen)
            # shm never encrypts (one kernel); across hosts, as asked.
            if want == "shm":
                assert seen[key + ".security"] == "none (shm: one host)", (me, peer, seen)
            else:
                assert seen[key + ".security"].endswith(security), (me, peer, seen)
    assert r["peer_info"]["rpc_ext.peer.worker1.transport"] == "shm"
    assert r["peer_info"]["rpc_ext.peer.worker2.transport"] == "tcp"
    assert r["peer_info"]["rpc_ext.peer.worker3.transport"] == "tcp"
    for rank in range(1, WORLD_SIZE):
        assert "error" not in res[rank], res[rank]
    print(json.dumps({rank: {k: v for k, v in res[rank].items() if k.endswith("_s")}
                      for rank in res}))


@pytest.mark.timeout(DEADLINE_S + 60)
def test_a_group_of_mixed_address_families_fails_naming_both(two_hosts, tmp_path):
    """Host 0's workers on IPv4, host 1's on IPv6: the first call across
    fails saying why, rather than hanging or timing out."""
    res = run_world(two_hosts, tmp_path, {"rpc_timeout": 30}, "mixed", must_succeed=False)
    error = res[0].get("error", "")
    assert "(IPv6) from this worker's address 10.213.0.1 (IPv4)" in error, res[0]
    assert "every worker of a group must listen on addresses of one family" in error, res[0]


def test_the_interface_option_takes_ipv6_where_an_interface_has_no_ipv4(two_hosts):
    """TORCH_RPC_EXT_SOCKET_IFNAME: an interface's IPv4 address, else its
    global or unique-local IPv6 one, else its link-local one with the
    interface as scope (what the agent listens on and advertises)."""
    hosts = two_hosts
    probe = [sys.executable, "-c", "from torch_rpc_ext import _C; print(_C.default_address())"]
    env = ["env", f"PYTHONPATH={ROOT}", f"TORCH_RPC_EXT_SOCKET_IFNAME={hosts.ifname(0)}",
           "TORCH_RPC_EXT_ADDR="]

    def chosen():
        return hosts.execute(0, [*env, *probe], timeout=120).stdout.strip()

    assert chosen() == hosts.ipv4(0)
    hosts.execute(0, ["ip", "addr", "del", f"{hosts.ipv4(0)}/24", "dev", hosts.ifname(0)])
    assert chosen() == hosts.ipv6(0)
    hosts.execute(0, ["ip", "addr", "del", f"{hosts.ipv6(0)}/64", "dev", hosts.ifname(0)])
    assert chosen() == hosts.link_local(0, via=0)
