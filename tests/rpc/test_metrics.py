# SPDX-License-Identifier: BSD-3-Clause
"""torch_rpc_ext.metrics (issue 47): latency and size histograms per peer
and call kind, counters and gauges, served in Prometheus's text format by
each worker, scraped here over HTTP and parsed by prometheus_client's own
parser."""

import contextlib
import os
import time
import urllib.request

import pytest
import torch
from torch.distributed import rpc

from tests.rpc.world import init, run_world

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="torch_rpc_ext[metrics] needs prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CALLS = 20


def slow_echo(x, seconds):
    time.sleep(seconds)
    return x


def raise_value_error():
    raise ValueError("a result, not a failed call")


def scrape(port: int) -> dict:
    """{family: [(sample name, labels, value)]} of http://127.0.0.1:port."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = [(s.name, s.labels, s.value) for s in fam.samples]
    return out


def traffic(rank, world_size):
    from torch_rpc_ext import metrics

    os.environ.pop("TORCH_RPC_EXT_METRICS_PORT", None)
    init(rank, world_size)
    port = metrics.serve(0, addr="127.0.0.1")
    out = {"port_again": metrics.serve(0) == port}
    if rank == 0:
        x = torch.ones(1000)  # 4000 bytes
        for _ in range(CALLS):
            rpc.rpc_sync("worker1", torch.add, args=(x, x))
        for _ in range(CALLS):
            rpc.rpc_sync("worker1", slow_echo, args=(x, 0.02))
        rref = rpc.remote("worker1", torch.add, args=(x, 1))
        rref.to_here()
        # The owner's answer to remote() itself can come after to_here()'s:
        # until it has, that call is still in flight.
        deadline = time.monotonic() + 30
        while not rref.confirmed_by_owner() and time.monotonic() < deadline:
            time.sleep(0.01)
        out["scrape"] = scrape(port)  # (before the barrier's own calls)
        # Three builtin calls answered with an error count as errors; a
        # Python function's exception (its result) does not.
        for args in ((x, torch.ones(3)),) * 3:
            with contextlib.suppress(RuntimeError):
                rpc.rpc_sync("worker1", torch.add, args=args)
        with contextlib.suppress(ValueError):
            rpc.rpc_sync("worker1", raise_value_error)
        out["errors"] = int(rpc.api._get_current_rpc_agent().get_metrics()[
            "rpc_ext.peer.worker1.errors"])
    rpc.api._barrier(["worker0", "worker1"])
    if rank == 1:
        out["scrape"] = scrape(port)
    rpc.shutdown()
    # The endpoint outlives the agent: nothing of it is served any more.
    out["after_shutdown"] = scrape(port)
    return out


def samples(scraped, family, name=None, **labels):
    return [(n, lab, v) for n, lab, v in scraped.get(family, [])
            if (name is None or n == name) and all(lab.get(k) == w for k, w in labels.items())]


def value(scraped, family, name, **labels):
    found = samples(scraped, family, name, **labels)
    assert len(found) == 1, (family, name, labels, scraped.get(family))
    return found[0][2]


def test_histograms_and_counters_scraped_from_both_workers():
    out = run_world(traffic, 2, timeout=150)
    caller, callee = out[0], out[1]
    assert caller["port_again"] and callee["port_again"]
    s = caller["scrape"]
    # Counters per peer: every call made by worker0 to worker1.
    made = value(s, "torch_rpc_ext_calls", "torch_rpc_ext_calls_total",
                 worker="worker0", peer="worker1", direction="made")
    assert made >= 2 * CALLS + 1
    # Round trips by kind: the builtin op (script), the Python function,
    # the remote() and its fetch (rref).
    fam = "torch_rpc_ext_call_duration_seconds"
    script = value(s, fam, fam + "_count", worker="worker0", peer="worker1", kind="script")
    python = value(s, fam, fam + "_count", worker="worker0", peer="worker1", kind="python")
    assert script == CALLS and python == CALLS
    assert value(s, fam, fam + "_count", worker="worker0", peer="worker1", kind="rref") >= 1
    # The slow function's round trips sum to at least 20 x 20 ms.
    assert value(s, fam, fam + "_sum", kind="python", worker="worker0") >= CALLS * 0.02
    # Buckets: cumulative, +Inf equals the count; the 20 ms calls lie above
    # the 16.384 ms bound.
    buckets = samples(s, fam, fam + "_bucket", kind="python", worker="worker0")
    counts = [v for _, _, v in sorted(buckets, key=lambda b: float(b[1]["le"]))]
    assert counts == sorted(counts) and counts[-1] == CALLS
    below = [v for _, lab, v in buckets if float(lab["le"]) <= 0.016384]
    assert max(below) == 0
    # Bounds a query can name as written (not 0.016384000000000003).
    assert "0.016384" in {lab["le"] for _, lab, _ in buckets}, buckets
    assert caller["errors"] == 3, caller["errors"]
    # Request bytes made: the 4000-byte storage (both arguments view it) in
    # a frame of a few hundred bytes more.
    fam = "torch_rpc_ext_request_bytes"
    assert value(s, fam, fam + "_count", kind="script", direction="made", worker="worker0") == CALLS
    script_bytes = value(s, fam, fam + "_sum", kind="script", direction="made", worker="worker0")
    assert CALLS * 4000 < script_bytes < CALLS * 8000

    # The callee served them: queue wait and run time per kind.
    c = callee["scrape"]
    fam = "torch_rpc_ext_serve_duration_seconds"
    # (The barrier's Python calls are served too.)
    assert value(c, fam, fam + "_count", worker="worker1", peer="worker0", kind="python") >= CALLS
    assert value(c, fam, fam + "_sum", worker="worker1", kind="python") >= CALLS * 0.02
    fam = "torch_rpc_ext_serve_queue_seconds"
    # (and the three failing builtin calls, made before the callee's scrape)
    assert value(c, fam, fam + "_count", worker="worker1", peer="worker0",
                 kind="script") == CALLS + 3
    served = value(c, "torch_rpc_ext_calls", "torch_rpc_ext_calls_total",
                   worker="worker1", peer="worker0", direction="served")
    assert served >= 2 * CALLS + 1
    fam = "torch_rpc_ext_response_bytes"
    assert value(c, fam, fam + "_count", kind="python", direction="served", worker="worker1") >= (
        CALLS)
    # Gauges, and the rest of get_metrics() as torch_rpc_ext_agent{key}.
    assert value(c, "torch_rpc_ext_serving", "torch_rpc_ext_serving", worker="worker1") >= 0
    assert samples(c, "torch_rpc_ext_agent", key="agent.thread_pool_size")
    # Connection events per peer: worker0 dialled worker1, which accepted it.
    fam = "torch_rpc_ext_connections"
    assert value(s, fam, fam + "_total", worker="worker0", peer="worker1",
                 direction="outbound") >= 1
    assert value(c, fam, fam + "_total", worker="worker1", peer="worker0",
                 direction="inbound") >= 1
    for fam in ("torch_rpc_ext_connection_losses", "torch_rpc_ext_reconnects",
                "torch_rpc_ext_dial_failures"):
        assert value(s, fam, fam + "_total", worker="worker0", peer="worker1") == 0
    # In flight per peer (none now), and counters by transport and channel
    # instead of torch_rpc_ext_agent gauges.
    assert value(s, "torch_rpc_ext_calls_in_flight", "torch_rpc_ext_calls_in_flight",
                 worker="worker0", peer="worker1") == 0
    fam = "torch_rpc_ext_heartbeat_timeouts"
    assert value(s, fam, fam + "_total", worker="worker0", transport="shm") == 0
    assert samples(s, "torch_rpc_ext_tls_handshakes", transport="tcp", outcome="failed")
    assert samples(s, "torch_rpc_ext_channel_bytes", channel="shm_ring")
    assert not samples(s, "torch_rpc_ext_agent", key="rpc_ext.shm.heartbeat_timeouts")
    assert caller["after_shutdown"] == {}


def from_env(rank, world_size, value):
    from torch_rpc_ext import metrics

    os.environ["TORCH_RPC_EXT_METRICS_PORT"] = value
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        init(rank, world_size)
    except ValueError as e:
        return {"error": str(e)}
    out = {"port": metrics.endpoint()}
    rpc.api._barrier(["worker0", "worker1"])
    out["scrape"] = scrape(out["port"]) if out["port"] else {}
    rpc.shutdown()
    return out


def test_the_environment_serves_metrics_from_init_rpc():
    """TORCH_RPC_EXT_METRICS_PORT, for a program one does not edit: each
    worker serves from init_rpc (0: any free port; else port + LOCAL_RANK),
    and a value that is not a port fails init_rpc naming it."""
    out = run_world(from_env, 2, timeout=120, value="0")
    assert all(out[r]["port"] for r in (0, 1)) and out[0]["port"] != out[1]["port"]
    assert samples(out[1]["scrape"], "torch_rpc_ext_calls", worker="worker1")
    bad = run_world(from_env, 1, timeout=60, value="http")
    assert "TORCH_RPC_EXT_METRICS_PORT='http' is not a port" in bad[0]["error"]


def test_a_local_rank_that_makes_no_port_is_named(monkeypatch):
    """The port is the base plus LOCAL_RANK: a LOCAL_RANK that is not a
    number, or one past the last port, is named (before session 94: a bare
    int() error, or port 79000 failing later in the HTTP server)."""
    from torch_rpc_ext import metrics

    monkeypatch.setenv("TORCH_RPC_EXT_METRICS_PORT", "9000")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert metrics.port_from_env() == 9003
    for rank in ("abc", "70000", "-1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.raises(ValueError, match=f"METRICS_PORT='9000' plus LOCAL_RANK='{rank}'"):
            metrics.port_from_env()
    monkeypatch.setenv("TORCH_RPC_EXT_METRICS_PORT", "0")
    assert metrics.port_from_env() == 0  # any free port, whatever the rank


class _FakeAgent:
    """What the collector reads of an agent: get_metrics() as a group with
    lanes and CUDA channels would give it."""

    def get_worker_info(self):
        return rpc.WorkerInfo("w0", 0)

    def get_metrics(self):
        return {"rpc_ext.channel.shm_ring.copied_bytes": "10",
                "rpc_ext.channel.shm_ring.segments": "1",
                "rpc_ext.channel.tcp_lanes.bytes": "20",
                "rpc_ext.channel.tcp_lanes.segments": "2",
                "rpc_ext.channel.cuda_ring.bytes_sent": "30",
                "rpc_ext.channel.cuda_ring.segments_sent": "3",
                "rpc_ext.channel.cuda_ring.bytes_received": "40",
                "rpc_ext.tcp.sources_held_off": "1",
                "rpc_ext.channel.tcp_lanes.sources_held_off": "2",
                "rpc_ext.tcp.hold_off_exempt_failures": "5",
                "rpc_ext.channel.tcp_lanes.hold_off_exempt_failures": "6",
                "rpc_ext.tcp.servers_held_off": "7",
                "rpc_ext.tcp.dials_held_off": "8"}

    def _call_costs(self):
        return []


def test_every_channel_that_sends_counts_in_the_channel_families(monkeypatch):
    # tcp_lanes' and the CUDA channels' bytes went only to the generic
    # torch_rpc_ext_agent gauge, under their own names.
    from torch_rpc_ext import metrics

    monkeypatch.setattr(metrics, "_agent", lambda: _FakeAgent())
    got = {}
    for fam in metrics.collector().collect():
        for s in fam.samples:
            got.setdefault(fam.name, {})[s.labels.get("channel") or s.labels.get("key")] = s.value
    assert got["torch_rpc_ext_channel_bytes"] == {"shm_ring": 10, "tcp_lanes": 20, "cuda_ring": 30}
    assert got["torch_rpc_ext_channel_segments"] == {"shm_ring": 1, "tcp_lanes": 2, "cuda_ring": 3}
    assert got["torch_rpc_ext_agent"] == {"rpc_ext.channel.cuda_ring.bytes_received": 40}


class _AgentNotServing(_FakeAgent):
    """An agent whose core says it does not serve, one loop stuck."""

    def _health(self, within):
        assert within == 0.25
        return "the agent of w0 is shutting down (rpc.shutdown())", [("shm", -1), ("tcp", 40)]


def test_health_says_why_a_worker_is_not_ready(monkeypatch):
    """health(): what the core says of the agent and its loops, put in
    words; its time bounded; another backend's agent is not judged."""
    from torch_rpc_ext import metrics

    monkeypatch.setattr(metrics, "_agent", lambda: _AgentNotServing())
    state = metrics.health(0.25)
    assert state["loops"] == {"shm": None, "tcp": 40e-6}, state
    assert not state["live"] and not state["ready"] and state["worker"] == "w0", state
    assert state["why"] == (
        "the agent of w0 is shutting down (rpc.shutdown()); the loop of shm did not run a "
        "task within 0.25 s: a handler blocks it (its peers' pings go unanswered too; they "
        "close its connections after heartbeat_timeout)"), state
    monkeypatch.setattr(metrics, "_agent", lambda: _FakeAgent())  # no _health: not ours
    state = metrics.health(0.25)
    assert state["live"] and not state["ready"] and "is not TORCH_RPC_EXT's" in state["why"]
    for bad in (0, -1, 61, "5"):
        with pytest.raises(ValueError, match="more than 0, at most 60"):
            metrics.health(bad)


def test_the_lanes_listener_s_hold_offs_count_beside_the_transports(monkeypatch):
    # tcp_lanes' sources held off went only to the generic gauge, out of
    # the Strangers panel's families.
    from torch_rpc_ext import metrics

    monkeypatch.setattr(metrics, "_agent", lambda: _FakeAgent())
    got = {}
    for fam in metrics.collector().collect():
        for s in fam.samples:
            if "transport" in s.labels:
                got.setdefault(fam.name, {})[s.labels["transport"]] = s.value
    assert got["torch_rpc_ext_sources_held_off"] == {"tcp": 1, "tcp_lanes": 2}
    assert got["torch_rpc_ext_hold_off_exempt_failures"] == {"tcp": 5, "tcp_lanes": 6}
    # And the other way: a server this worker stopped dialing.
    assert got["torch_rpc_ext_servers_held_off"] == {"tcp": 7}
    assert got["torch_rpc_ext_dials_held_off"] == {"tcp": 8}


def metrics_port_taken(rank, world_size, port):
    os.environ["TORCH_RPC_EXT_METRICS_PORT"] = str(port)
    os.environ["LOCAL_RANK"] = "0"
    try:
        init(rank, world_size)
    except OSError as e:
        return {"error": str(e)}
    rpc.shutdown()
    return {"error": None}


def test_a_metrics_port_taken_fails_init_naming_the_variables():
    # It failed with a bare "Address already in use", after a round with
    # the peers through the store.
    import socket

    held = socket.create_server(("0.0.0.0", 0))
    try:
        out = run_world(metrics_port_taken, 2, timeout=60,
                        port=held.getsockname()[1])
    finally:
        held.close()
    for r in (out[0], out[1]):
        assert r["error"] and "TORCH_RPC_EXT_METRICS_PORT=" in r["error"], r
        assert "LOCAL_RANK='0'" in r["error"] and "in use" in r["error"], r


IDLE_CLIENTS = """
import socket, sys, threading, time, urllib.request
from torch_rpc_ext import metrics
metrics.CLIENT_TIMEOUT = 2.0
port = metrics.serve(0, addr="127.0.0.1")
base = threading.active_count()
idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
deadline = time.monotonic() + 1.5
peak = 0
while time.monotonic() < deadline:
    peak = max(peak, threading.active_count() - base)
    time.sleep(0.02)
# Past the client timeout, every idle one dropped: a scrape is served.
time.sleep(2.0)
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
time.sleep(0.5)
print(peak, threading.active_count() - base)
"""


def test_idle_clients_hold_no_thread_past_the_client_timeout():
    # prometheus_client's own server kept a thread for every connection, for
    # as long as its client kept it open, however many.
    import subprocess
    import sys

    from torch_rpc_ext import metrics

    done = subprocess.run([sys.executable, "-c", IDLE_CLIENTS], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    peak, after = map(int, done.stdout.split())
    # (64 at once here; a loaded host may have dropped some before the last
    # came, which keeps it under the cap all the same.)
    assert 0 < peak <= metrics.MAX_CLIENTS, (peak, after)
    assert after == 0, (peak, after)


def endpoint_asked_at_once(rank, world_size):
    from torch_rpc_ext import metrics

    os.environ["TORCH_RPC_EXT_METRICS_PORT"] = "0"
    if rank == 1:
        # A slow start of the HTTP server (a loaded host): whatever the agent
        # serves must wait for it.
        classes = metrics._server_classes

        def slow_start():
            time.sleep(1.5)
            return classes()

        metrics._server_classes = slow_start
    init(rank, world_size)
    out = {"own": metrics.endpoint()}
    if rank == 0:
        out["peer"] = rpc.rpc_sync("worker1", metrics.endpoint)
    rpc.shutdown()
    return out


def test_a_worker_serves_its_metrics_before_it_serves_calls():
    """A peer's first call may ask where the metrics are (a tutorial's
    worker0 did): until session 78 the endpoint started after the agent,
    which already served calls, and the answer could be None (1.5 s of
    slow start: always)."""
    out = run_world(endpoint_asked_at_once, 2, timeout=120)
    assert out[0]["peer"] == out[1]["own"] and out[1]["own"]


def get(port: int, path: str) -> tuple[int, dict]:
    import json
    import urllib.error

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health_probed(rank, world_size):
    from torch_rpc_ext import _testing, metrics

    out = {}
    if rank == 0:
        port = metrics.serve(0, addr="127.0.0.1")
        out["before"] = {p: get(port, p) for p in ("/livez", "/readyz")}
    # (The peer's heartbeat far from the 6 s stall below, on a loaded host.)
    init(rank, world_size, heartbeat_timeout=30)
    rpc.api._barrier(["worker0", "worker1"])
    if rank == 1:
        # A Python function that runs 6 s on worker0: no handler blocks.
        slow = rpc.rpc_async("worker0", slow_echo, args=(1, 6.0))
    if rank == 0:
        agent = rpc.api._get_current_rpc_agent()
        deadline = time.monotonic() + 10
        while (agent.get_metrics().get("agent.server_active_calls", "0") == "0"
               and time.monotonic() < deadline):
            time.sleep(0.01)
        out["slow_call"] = (agent.get_metrics().get("agent.server_active_calls"),
                            get(port, "/livez?timeout=2"))
        out["serving"] = {p: get(port, p) for p in ("/livez", "/readyz")}
        out["bad"] = [get(port, "/livez?timeout=forever"), get(port, "/readyz?timeout=")]
        # A handler that blocks the shm loop (a deadlock, a blocking call):
        # the probes name it while it does, and pass again once it ends.
        assert _testing.agent.stall_loop("shm", 6.0)
        stalled_at = time.monotonic()
        out["stalled"] = {p: get(port, p + "?timeout=1.5") for p in ("/livez", "/readyz")}
        time.sleep(max(0.0, stalled_at + 6.5 - time.monotonic()))
        out["after_stall"] = get(port, "/livez?timeout=10")
        out["metrics_still"] = bool(scrape(port))
    if rank == 1:
        assert slow.wait() == 1
    rpc.api._barrier(["worker0", "worker1"])
    rpc.shutdown()
    if rank == 0:
        out["after"] = {p: get(port, p) for p in ("/livez", "/readyz")}
    return out


def test_health_probes_follow_the_agent_and_its_loops():
    """/livez and /readyz on the metrics endpoint (for Kubernetes' probes):
    live while every transport's loop runs a task within the probe's time
    (a Python function that runs long does not stop it), ready while the
    agent serves calls too; JSON saying why not."""
    out = run_world(health_probed, 2, timeout=150)[0]
    for when in ("before", "after"):
        (live, live_body), (ready, ready_body) = out[when]["/livez"], out[when]["/readyz"]
        assert live == 200 and live_body["live"], (when, live_body)
        assert ready == 503 and not ready_body["ready"], (when, ready_body)
        assert "no RPC agent in this process" in ready_body["why"], (when, ready_body)
    serving, (code, body) = out["slow_call"]
    assert serving == "1" and code == 200 and body["live"], (serving, body)
    for path in ("/livez", "/readyz"):
        code, body = out["serving"][path]
        assert code == 200 and body["live"] and body["ready"] and body["why"] == "", body
        assert body["worker"] == "worker0" and "shm" in body["loops"], body
        assert all(isinstance(t, float) and t >= 0 for t in body["loops"].values()), body
    for (code, body), text in zip(out["bad"], ("timeout='forever'", "timeout=''")):
        assert code == 400 and f"{text} is not a number of seconds" in body["why"], body
    for path in ("/livez", "/readyz"):
        code, body = out["stalled"][path]
        assert code == 503 and not body["live"] and not body["ready"], (path, body)
        assert body["loops"]["shm"] is None, body
        assert "the loop of shm did not run a task within 1.5 s" in body["why"], body
        assert all(t is not None for name, t in body["loops"].items() if name != "shm"), body
    code, body = out["after_stall"]
    assert code == 200 and body["loops"]["shm"] is not None, body
    assert out["metrics_still"]


def top_once(port):
    """What `python -m torch_rpc_ext.top` reads from this worker's endpoint,
    and the screen it draws from that one reading."""
    from torch_rpc_ext import top

    endpoint = f"127.0.0.1:{port}"
    seen = top.scrape(endpoint)
    return seen, top.render([endpoint], {endpoint: seen}, {})


def wait_for_file(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.exists(path)


def calls_waited_on(rank, world_size, release, costs):
    from torch_rpc_ext import metrics

    os.environ.pop("TORCH_RPC_EXT_METRICS_PORT", None)
    if not costs:  # the benchmark's "off" rows: ages are kept all the same
        os.environ["TORCH_RPC_EXT_CALL_COSTS"] = "0"
    out = {}
    init(rank, world_size)
    if rank == 0:
        port = metrics.serve(0, addr="127.0.0.1")
        out["idle"] = metrics.calls_in_flight()
        sent = time.monotonic()
        # Three calls worker1 holds until the file appears: the first never
        # expires, the others in 120 s.
        futs = [rpc.rpc_async("worker1", wait_for_file, args=(release,), timeout=0),
                rpc.rpc_async("worker1", wait_for_file, args=(release,), timeout=120),
                rpc.rpc_async("worker1", wait_for_file, args=(release,), timeout=120)]
        out["first"] = metrics.calls_in_flight()
        time.sleep(0.05)
        out["later"] = metrics.calls_in_flight()
        out["since_sent"] = time.monotonic() - sent
        out["endpoint"] = [get(port, "/calls?limit=2"), get(port, "/calls?limit=0"),
                           get(port, "/calls?limit=abc"), get(port, "/calls?limit=+2")]
        out["scrape"] = scrape(port)
        seen, screen = top_once(port)
        out["top"] = (seen.oldest, screen)
        out["since_scraped"] = time.monotonic() - sent
        open(release, "w").close()
        out["results"] = [f.wait() for f in futs]
        out["answered"] = metrics.calls_in_flight()
        out["scrape_after"] = scrape(port)
    rpc.shutdown()
    if rank == 0:
        out["after"] = metrics.calls_in_flight()
    return out


@pytest.mark.parametrize("costs", [True, False], ids=["costs", "no-costs"])
def test_calls_in_flight_say_what_a_worker_waits_on(tmp_path, costs):
    """metrics.calls_in_flight() and the endpoint's /calls: a worker's
    calls in flight, oldest first, each with its callee, kind, age and
    timeout; the Prometheus gauge of the oldest one's age per peer. The ages
    hold with TORCH_RPC_EXT_CALL_COSTS=0 too (the send time was kept only
    for the histograms before)."""
    out = run_world(calls_waited_on, 2, timeout=150, release=str(tmp_path / "go"),
                    costs=costs)[0]
    assert out["idle"] == {"worker": "worker0", "in_flight": 0, "calls": [], "why": ""}
    first, later = out["first"], out["later"]
    assert first["in_flight"] == 3 and len(first["calls"]) == 3, first
    never, bounded, third = first["calls"]
    assert never["id"] < bounded["id"] < third["id"], first  # oldest first
    for call in first["calls"]:
        assert call["to"] == "worker1" and call["kind"] == "python", call
        assert 0 <= call["age"] <= out["since_sent"], (call, out["since_sent"])
    assert never["timeout"] is None and bounded["timeout"] == third["timeout"] == 120.0, first
    assert [c["id"] for c in later["calls"]] == [c["id"] for c in first["calls"]], later
    assert all(b["age"] > a["age"] for a, b in zip(first["calls"], later["calls"])), later
    assert all(c["age"] <= out["since_sent"] for c in later["calls"]), later
    (code, body), (zero, zero_body), (word, word_body), (sign, _) = out["endpoint"]
    assert code == 200 and body["in_flight"] == 3 and body["worker"] == "worker0", body
    # The two oldest of three, oldest first.
    assert [c["id"] for c in body["calls"]] == [never["id"], bounded["id"]], body
    assert zero == 400 and "limit='0' is not a whole number" in zero_body["why"], zero_body
    assert word == 400 and "limit='abc'" in word_body["why"], word_body
    assert sign == 400  # ("+" is a space in a query: " 2")
    age = value(out["scrape"], "torch_rpc_ext_oldest_call_age_seconds",
                "torch_rpc_ext_oldest_call_age_seconds", worker="worker0", peer="worker1")
    assert 0 < age <= out["since_scraped"] + 0.001, (age, out["since_scraped"])
    assert value(out["scrape"], "torch_rpc_ext_calls_in_flight",
                 "torch_rpc_ext_calls_in_flight", worker="worker0", peer="worker1") == 3
    assert not samples(out["scrape"], "torch_rpc_ext_agent",
                       key="rpc_ext.peer.worker1.oldest_call_ms")  # its own family only
    oldest, screen = out["top"]
    assert 0 < oldest["worker1"] <= out["since_scraped"] + 0.001, oldest
    row = next(line for line in screen.splitlines() if line.startswith("worker0 "))
    from torch_rpc_ext.top import _seconds

    # The oldest call's age; then nothing served, nothing held.
    assert row.split()[-3:] == [_seconds(oldest["worker1"]), "0", "-"], screen
    assert out["results"] == [True, True, True]
    assert out["answered"]["in_flight"] == 0 and out["answered"]["calls"] == [], out["answered"]
    assert value(out["scrape_after"], "torch_rpc_ext_oldest_call_age_seconds",
                 "torch_rpc_ext_oldest_call_age_seconds", worker="worker0",
                 peer="worker1") == 0
    assert out["after"]["worker"] is None and "no RPC agent" in out["after"]["why"], out["after"]


def test_calls_in_flight_check_their_limit(monkeypatch):
    from torch_rpc_ext import metrics

    for bad in (0, -1, 1001, 2.5, True, "3"):
        with pytest.raises(ValueError, match="a whole number of calls, 1 to 1000"):
            metrics.calls_in_flight(bad)
    monkeypatch.setattr(metrics, "_agent", lambda: _FakeAgent())  # not ours
    state = metrics.calls_in_flight()
    assert state["calls"] == [] and "is not TORCH_RPC_EXT's (_FakeAgent)" in state["why"], state


def held_running(release, threads_dir):
    """Holds its request until `release` appears, having written the id of
    the thread it runs on into `threads_dir`."""
    import threading

    open(os.path.join(threads_dir, str(threading.get_native_id())), "w").close()
    return wait_for_file(release)


@rpc.functions.async_execution
def held_waiting(release):
    """Returns at once a future completed when `release` appears: no thread
    of the server holds the request meanwhile."""
    import threading

    fut = torch.futures.Future()
    threading.Thread(target=lambda: fut.set_result(wait_for_file(release)),
                     daemon=True).start()
    return fut


def unpicklable_result():
    return lambda: None  # (pickle refuses a lambda)


def requests_held(rank, world_size, release, threads_dir):
    from torch_rpc_ext import metrics

    os.environ.pop("TORCH_RPC_EXT_METRICS_PORT", None)
    out = {}
    init(rank, world_size)
    if rank == 0:
        out["idle"] = metrics.requests_being_served()
        try:  # an answer that cannot be made: its entry goes all the same
            rpc.rpc_sync("worker1", unpicklable_result)
        except Exception as e:  # noqa: BLE001 (what torch raises varies)
            out["unpicklable"] = str(e)
        futs = [rpc.rpc_async("worker1", held_running, args=(release, threads_dir), timeout=120),
                rpc.rpc_async("worker1", held_waiting, args=(release,), timeout=120),
                rpc.rpc_async("worker1", held_running, args=(release, threads_dir), timeout=120)]
        out["calls"] = metrics.calls_in_flight()
        out["results"] = [f.wait() for f in futs]
    else:
        port = metrics.serve(0, addr="127.0.0.1")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until both functions run
            state = metrics.requests_being_served()
            stages = sorted(r["stage"] for r in state["requests"])
            if stages == ["running", "running", "waiting"] and len(os.listdir(threads_dir)) == 2:
                break
            time.sleep(0.01)
        out["first"] = state
        time.sleep(0.05)
        out["later"] = metrics.requests_being_served()
        out["endpoint"] = [get(port, "/serving?limit=2"), get(port, "/serving?limit=0")]
        out["scrape"] = scrape(port)
        seen, screen = top_once(port)
        out["top"] = (seen.held, screen)
        out["threads"] = sorted(int(name) for name in os.listdir(threads_dir))
        open(release, "w").close()
        deadline = time.monotonic() + 60
        while metrics.requests_being_served()["serving"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out["answered"] = metrics.requests_being_served()
        out["scrape_after"] = scrape(port)
    rpc.shutdown()
    if rank == 1:
        out["after"] = metrics.requests_being_served()
    return out


def test_requests_being_served_say_what_a_worker_holds(tmp_path):
    """metrics.requests_being_served() and the endpoint's /serving: the
    callee's side of calls_in_flight, under the same ids. Two Python
    functions held running (each on the thread it says it runs on) and an
    @async_execution one whose future is not complete (waiting: no thread
    holds it), oldest first; the Prometheus gauge of the oldest one's age;
    top's columns; empty once answered (a request whose answer could not be
    made included) and after shutdown."""
    threads_dir = tmp_path / "threads"
    threads_dir.mkdir()
    out = run_world(requests_held, 2, timeout=150, release=str(tmp_path / "go"),
                    threads_dir=str(threads_dir))
    caller, callee = out[0], out[1]
    assert caller["idle"] == {"worker": "worker0", "serving": 0, "requests": [], "why": ""}
    assert caller["results"] == [True, True, True]
    assert "lambda" in caller["unpicklable"], caller["unpicklable"]
    first, later = callee["first"], callee["later"]
    assert first["worker"] == "worker1" and first["serving"] == 3, first
    # The ids the caller's calls in flight show, in the order it sent them.
    assert [r["id"] for r in first["requests"]] == [c["id"] for c in caller["calls"]["calls"]]
    running, waiting, running_too = first["requests"]
    assert [r["stage"] for r in first["requests"]] == ["running", "waiting", "running"], first
    assert sorted([running["thread"], running_too["thread"]]) == callee["threads"], first
    assert waiting["thread"] is None, first
    for request in first["requests"]:
        assert request["from"] == "worker0" and request["kind"] == "python", request
        assert request["age"] > 0, request
    assert [r["id"] for r in later["requests"]] == [r["id"] for r in first["requests"]], later
    assert all(b["age"] > a["age"] for a, b in zip(first["requests"], later["requests"])), later
    (code, body), (zero, zero_body) = callee["endpoint"]
    assert code == 200 and body["serving"] == 3 and body["worker"] == "worker1", body
    assert [r["id"] for r in body["requests"]] == [running["id"], waiting["id"]], body
    assert zero == 400 and "limit='0' is not a whole number of requests" in zero_body["why"]
    age = value(callee["scrape"], "torch_rpc_ext_oldest_request_age_seconds",
                "torch_rpc_ext_oldest_request_age_seconds", worker="worker1")
    assert age >= later["requests"][0]["age"] - 0.001, (age, later)
    assert value(callee["scrape"], "torch_rpc_ext_serving", "torch_rpc_ext_serving",
                 worker="worker1") == 3
    assert not samples(callee["scrape"], "torch_rpc_ext_agent",
                       key="rpc_ext.oldest_request_ms")  # its own family only
    held, screen = callee["top"]
    assert held >= age, (held, age)
    row = next(line for line in screen.splitlines() if line.startswith("worker1 "))
    from torch_rpc_ext.top import _seconds

    assert row.split()[-2:] == ["3", _seconds(held)], screen  # serving, held
    assert callee["answered"]["serving"] == 0 and callee["answered"]["requests"] == []
    assert value(callee["scrape_after"], "torch_rpc_ext_oldest_request_age_seconds",
                 "torch_rpc_ext_oldest_request_age_seconds", worker="worker1") == 0
    assert callee["after"]["worker"] is None and "no RPC agent" in callee["after"]["why"]


def held_with_rref(rref, release, threads_dir):
    """Runs once this worker's fork of `rref` is confirmed by its owner; then
    as held_running."""
    import threading

    open(os.path.join(threads_dir, str(threading.get_native_id())), "w").close()
    wait_for_file(release)
    return rref.to_here().sum().item()


def rref_arguments_held(rank, world_size, release, threads_dir, polling):
    import torch_rpc_ext.testing as faulty
    from torch_rpc_ext import metrics

    os.environ.pop("TORCH_RPC_EXT_METRICS_PORT", None)
    # worker1's fork request to the RRef's owner (worker2) held back 3 s.
    rpc.init_rpc(
        f"worker{rank}", rank=rank, world_size=world_size,
        backend=rpc.backend_registry.BackendType[faulty.FAULTY_BACKEND_NAME],
        rpc_backend_options=faulty.FaultyRpcExtBackendOptions(
            address="127.0.0.1", rpc_timeout=60, messages_to_delay={"RREF_FORK_REQUEST": 3}))
    out = {}
    if rank == 0:
        rref = rpc.remote("worker2", torch.add, args=(torch.ones(2), 0))
        rref.to_here()
        assert wait_for_file(polling), "worker1 never began to watch"
        out["result"] = rpc.rpc_sync("worker1", held_with_rref,
                                     args=(rref, release, threads_dir))
    elif rank == 1:
        seen = set()
        open(polling, "w").close()
        deadline = time.monotonic() + 60
        while not os.listdir(threads_dir) and time.monotonic() < deadline:
            seen |= {(r["stage"], r["thread"], r["kind"])
                     for r in metrics.requests_being_served()["requests"]}
            time.sleep(0.01)
        if not os.listdir(threads_dir):
            open(release, "w").close()
            raise AssertionError(f"the function never ran within 60 s; seen: {seen}")
        out["seen"] = seen
        out["running"] = metrics.requests_being_served()
        out["thread"] = int(os.listdir(threads_dir)[0])
        open(release, "w").close()
    rpc.shutdown()
    return out


def test_a_call_whose_rref_arguments_wait_for_their_owner_shows_where_it_runs(tmp_path):
    """A call whose RRef argument's fork the owner has not confirmed yet
    waits (no thread holds it) until the owner's answer comes, then runs on
    the thread that received it: listed running there, not still waiting."""
    threads_dir = tmp_path / "threads"
    threads_dir.mkdir()
    out = run_world(rref_arguments_held, 3, timeout=150, release=str(tmp_path / "go"),
                    threads_dir=str(threads_dir), polling=str(tmp_path / "polling"))
    assert out[0]["result"] == 2.0
    callee = out[1]
    assert ("waiting", None, "python") in callee["seen"], callee["seen"]
    [request] = callee["running"]["requests"]
    assert request["stage"] == "running" and request["from"] == "worker0", request
    assert request["thread"] == callee["thread"], (request, callee["thread"])


def test_requests_being_served_check_their_limit(monkeypatch):
    from torch_rpc_ext import metrics

    for bad in (0, 1001, True, "3"):
        with pytest.raises(ValueError, match="requests_being_served.*a whole number of "
                                             "requests, 1 to 1000"):
            metrics.requests_being_served(bad)
    monkeypatch.setattr(metrics, "_agent", lambda: _FakeAgent())  # not ours
    state = metrics.requests_being_served()
    assert state["requests"] == [] and "is not TORCH_RPC_EXT's (_FakeAgent)" in state["why"]


def traffic_without_costs(rank, world_size):
    os.environ["TORCH_RPC_EXT_CALL_COSTS"] = "0"
    return traffic(rank, world_size)


def test_call_costs_can_be_turned_off():
    """TORCH_RPC_EXT_CALL_COSTS=0 (the benchmark's "off" rows): no
    histogram is kept; the counters still are."""
    out = run_world(traffic_without_costs, 2, timeout=150)
    s = out[0]["scrape"]
    assert not [f for f, found in s.items() if any(n.endswith("_bucket") for n, _, _ in found)]
    assert value(s, "torch_rpc_ext_calls", "torch_rpc_ext_calls_total",
                 worker="worker0", peer="worker1", direction="made") >= 2 * CALLS


# ---- a real Prometheus scraping a live group ---------------------------------


def live_group(rank, world_size, ports, stop_file):
    """Serve on `ports[rank]`; worker0 calls the others until `stop_file`
    appears (at most 90 s)."""
    from torch_rpc_ext import metrics

    os.environ.pop("TORCH_RPC_EXT_METRICS_PORT", None)
    init(rank, world_size)
    metrics.serve(ports[rank], addr="127.0.0.1")
    calls = 0
    if rank == 0:
        x = torch.ones(100)
        deadline = time.monotonic() + 90
        while not os.path.exists(stop_file) and time.monotonic() < deadline:
            for peer in ("worker1", "worker2"):
                rpc.rpc_sync(peer, torch.add, args=(x, x))
                calls += 1
            time.sleep(0.005)
    rpc.shutdown()
    return calls


class LiveGroup:
    """live_group's three workers, forked from this (the main) thread: a
    fork from a helper thread could copy a lock the main thread holds (an
    import's, a resolver's) into a worker that then never gets it."""

    def __init__(self, ports, stop_file):
        import torch.multiprocessing as mp

        from tests.rpc import world

        ctx = mp.get_context("fork")
        self.queue = ctx.Queue()
        self.stop_file = stop_file
        master = world.free_port()
        self.procs = [
            ctx.Process(target=world._entry, args=(
                live_group, r, 3, master, self.queue, {"ports": ports, "stop_file": stop_file}))
            for r in range(3)]
        for p in self.procs:
            p.start()

    def stop(self, timeout=120) -> dict:
        """Stops the calls; what each worker returned (its traceback if it
        failed)."""
        import pickle

        open(self.stop_file, "w").close()
        results = {}
        try:
            for _ in self.procs:
                rank, ok, value = self.queue.get(timeout=timeout)
                results[rank] = pickle.loads(value) if ok else value
        finally:
            for p in self.procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
        return results


def query(base: str, promql: str) -> list:
    import json
    import urllib.parse

    url = f"{base}/api/v1/query?query={urllib.parse.quote(promql)}"
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_a_real_prometheus_scrapes_a_live_group(tmp_path):
    """Debian's prometheus, started here on a free port with a generated
    config, scrapes a 3-worker group every second; a call rate and a p99
    come back through its HTTP query API."""
    import shutil
    import subprocess

    from tests.rpc.world import free_port

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (Debian's `prometheus` package: "
                    "tools/setup_env.sh installs it where apt is available)")
    ports = [free_port() for _ in range(3)]
    web = free_port()
    config = tmp_path / "prometheus.yml"
    targets = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: rpc\n    static_configs: [{{targets: [{targets}]}}]\n")
    # Not ours to sanitize: under tools/sanitize.sh thread, a Go program
    # with libtsan preloaded ignored SIGTERM and outlived the test.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    server = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    group = LiveGroup(ports, str(tmp_path / "stop"))
    base = f"http://127.0.0.1:{web}"
    rate, p99, up = [], [], []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (rate and p99 and len(up) == 3):
            time.sleep(1)
            try:
                up = [r for r in query(base, 'up{job="rpc"} == 1')]
                rate = query(base, 'sum(rate(torch_rpc_ext_calls_total'
                                   '{worker="worker0", direction="made"}[5s])) > 0')
                p99 = query(base, 'histogram_quantile(0.99, sum by (le) (rate('
                                  'torch_rpc_ext_call_duration_seconds_bucket'
                                  '{worker="worker0", kind="script"}[5s])))')
            except OSError:
                continue  # not listening yet
        # Every query of the Grafana dashboard (docs/grafana) is valid
        # PromQL over what the workers serve; most have data already.
        dashboard = []
        if rate and p99:
            import json
            from pathlib import Path

            spec = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana"
                               / "torch_rpc_ext.json").read_text())
            for panel in spec["panels"]:
                for target in panel["targets"]:
                    expr = (target["expr"].replace("$__rate_interval", "5s")
                            .replace("$worker", ".*"))
                    dashboard.append((panel["title"], expr, query(base, expr)))
    finally:
        results = group.stop()
        server.terminate()
        try:
            _, err = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()  # it must not outlive the test, whatever it says
            _, err = server.communicate()
            err += "\n<prometheus ignored SIGTERM for 30 s: killed>"
    assert len(up) == 3, err[-2000:]
    assert rate and float(rate[0]["value"][1]) > 0
    assert p99 and 0 < float(p99[0]["value"][1]) < 10
    assert isinstance(results[0], int) and results[0] > 0, results
    assert len(dashboard) >= 10
    with_data = {title for title, _, result in dashboard if result}
    assert {"Calls per second, made and served", "Round trip p50 / p99 by peer (calls made)",
            "Bytes per second on the wire", "Calls made per second by kind",
            "Connection events per second",
            "Oldest call in flight, by peer (what a worker waits on)",
            "Oldest request being served, by worker (what a worker holds)"} <= with_data, dashboard


# ---- python -m torch_rpc_ext.top ---------------------------------------------


@pytest.mark.parametrize("answer", [
    # A worker gone mid-answer: fewer bytes than its length said.
    b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\nabc",
    # A port that is not a metrics endpoint.
    b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n<html><body>hi</body></html>",
    # Not HTTP at all.
    b"SSH-2.0-OpenSSH_9.2\r\n",
])
def test_top_shows_an_endpoint_that_answers_wrong_as_unreachable(answer):
    # It raised out of the whole view (only OSError was caught).
    import socket
    import threading

    from torch_rpc_ext.top import scrape

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_once():
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)

    t = threading.Thread(target=answer_once, daemon=True)
    t.start()
    try:
        sample = scrape(f"127.0.0.1:{port}", timeout=5)
    finally:
        t.join(10)
        server.close()
    assert sample.error, sample


def test_top_says_why_a_worker_is_not_ready():
    """Under a worker whose /readyz answers 503, top prints its why; an
    endpoint without /readyz (metrics there instead) or a ready one adds
    nothing."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from torch_rpc_ext.top import readiness, render, scrape

    answers = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?")[0]
            code, body = answers.get(path, (200, b"# HELP x y\n# TYPE x gauge\nx 1\n"))
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"127.0.0.1:{server.server_address[1]}"
    try:
        assert readiness(endpoint) == ""  # metrics text at /readyz: an older endpoint
        why = "the loop of shm did not run a task within 0.5 s: a handler blocks it"
        answers["/readyz"] = (503, json.dumps({"ready": False, "live": False, "why": why}).encode())
        sample = scrape(endpoint)
        assert not sample.error and sample.not_ready == why, sample
        screen = render([endpoint], {endpoint: sample}, {})
        assert f"not ready: {why}" in screen, screen
        answers["/readyz"] = (200, json.dumps({"ready": True, "why": ""}).encode())
        sample = scrape(endpoint)
        assert sample.not_ready == "" and "not ready" not in render([endpoint], {endpoint: sample}, {})
    finally:
        server.shutdown()
        server.server_close()


def test_top_quantile_interpolates_as_prometheus_does():
    from torch_rpc_ext.top import quantile

    before = {0.001: 0.0, 0.002: 0.0, 0.004: 0.0, float("inf"): 0.0}
    # 100 calls: 50 at or below 1 ms, 99 at or below 2 ms, 100 below 4 ms.
    after = {0.001: 50.0, 0.002: 99.0, 0.004: 100.0, float("inf"): 100.0}
    assert quantile(0.5, before, after) == pytest.approx(0.001)
    assert quantile(0.99, before, after) == pytest.approx(0.002)
    assert quantile(0.995, before, after) == pytest.approx(0.003)
    assert quantile(0.99, after, after) is None  # nothing in between


def test_top_shows_every_worker_of_a_live_group(tmp_path):
    """`python -m torch_rpc_ext.top` in a pseudo-terminal against a live
    3-worker group: its first screen has every worker, worker0's calls to
    both peers, and a p99."""
    import pty
    import re
    import select
    import subprocess
    import sys

    from tests.rpc.world import free_port

    ports = [free_port() for _ in range(3)]
    group = LiveGroup(ports, str(tmp_path / "stop"))
    screen, proc = "", None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until all three serve
            try:
                for p in ports:
                    urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        ours, theirs = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch_rpc_ext.top", *(f"127.0.0.1:{p}" for p in ports)],
            stdin=theirs, stdout=theirs, stderr=theirs, close_fds=True)
        os.close(theirs)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready, _, _ = select.select([ours], [], [], 1)
            if ready:
                try:
                    screen += os.read(ours, 65536).decode(errors="replace")
                except OSError:
                    break
            first = screen.split("\x1b[H\x1b[2J")
            if len(first) > 1 and all(f"worker{r}" in first[1] for r in range(3)):
                break
        os.close(ours)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        results = group.stop()
    assert all(isinstance(results[r], int) for r in range(3)), results
    first = screen.split("\x1b[H\x1b[2J")[1]
    lines = first.splitlines()
    for r in range(3):
        assert any(line.startswith(f"worker{r} ") for line in lines), first
    # worker0's rows for each peer, with a rate and a p99 in milliseconds.
    assert re.search(r"^\s+worker1\s+\d+", first, re.M) and re.search(r"^\s+worker2\s+", first, re.M)
    assert re.search(r"worker0\s+\(all\)\s+[1-9]\d*\s+\d+\s+[\d.]+ms", first), first


# ---- profiled calls keep their kind ------------------------------------------


def _costs_by_kind(metric):
    agent = rpc.api._get_current_rpc_agent()
    return {kind: sum(counts) for _, kind, m, _, counts, _ in agent._call_costs() if m == metric}


def profiled_calls(rank, world_size):
    init(rank, world_size)
    out = None
    if rank == 0:
        x = torch.ones(4)
        # upstream's profiler wraps the request (RUN_WITH_PROFILING_REQ)
        # before the agent sees it; torch.profiler's is wrapped by ours.
        with torch.autograd.profiler.profile():
            rpc.rpc_sync("worker1", torch.add, args=(x, 1))
        with torch.profiler.profile():
            rpc.rpc_sync("worker1", torch.add, args=(x, 2))
        out = (_costs_by_kind("call_seconds"), rpc.rpc_sync("worker1", _costs_by_kind,
                                                            args=("serve_seconds",)))
    rpc.api._barrier(["worker0", "worker1"])
    rpc.shutdown()
    return out


def test_a_profiled_call_counts_as_the_kind_it_wraps():
    # Before session 96 both ends counted upstream's profiled calls, and the
    # callee torch.profiler's too, as "other".
    made, served = run_world(profiled_calls, 2, timeout=150)[0]
    assert made.get("script") == 2 and "other" not in made, made
    assert served.get("script") == 2 and "other" not in served, served
