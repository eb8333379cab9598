# SPDX-License-Identifier: BSD-3-Clause
"""Prometheus metrics of a running worker (docs/observability.md).

``serve(port)`` starts an HTTP endpoint in this process that Prometheus
scrapes (the text exposition format, by the ``prometheus_client`` library:
``pip install 'torch_rpc_ext[metrics]'``). What it serves is read at each
scrape from the worker's current agent, so one endpoint outlives
``rpc.shutdown()`` and a later ``init_rpc`` of the same process:

- counters per peer: ``torch_rpc_ext_calls_total{direction="made"|"served"}``,
  ``torch_rpc_ext_bytes_total{direction="sent"|"received"}``,
  ``torch_rpc_ext_errors_total``, ``torch_rpc_ext_timeouts_total``,
  ``torch_rpc_ext_rejected_frames_total``;
- histograms per peer and call kind (``script``: builtin operators and
  TorchScript functions, ``python``, ``rref``, ``autograd``, ``other``):
  ``torch_rpc_ext_call_duration_seconds`` (calls made: request sent to
  response received), ``torch_rpc_ext_serve_queue_seconds`` and
  ``torch_rpc_ext_serve_duration_seconds`` (calls served: waiting for a
  thread, then running), ``torch_rpc_ext_request_bytes`` and
  ``torch_rpc_ext_response_bytes`` (``direction="made"|"served"``);
- connection events per peer: ``torch_rpc_ext_connections_total{direction=
  "outbound"|"inbound"}``, ``torch_rpc_ext_reconnects_total``,
  ``torch_rpc_ext_dial_failures_total``, ``torch_rpc_ext_connection_losses_total``;
- counters per worker: TLS handshakes (``outcome="ok"|"failed"``), heartbeat
  timeouts, unauthenticated and rejected connections, a dynamic group's
  membership changes, lapsed leases and refused proofs of its passphrase,
  bytes and segments per channel, CUDA landings (docs/observability.md);
- gauges: ``torch_rpc_ext_calls_in_flight`` and
  ``torch_rpc_ext_oldest_call_age_seconds`` (per peer), ``torch_rpc_ext_serving``,
  ``torch_rpc_ext_oldest_request_age_seconds``,
  ``torch_rpc_ext_idle_threads``, and every other numeric value of the
  agent's ``get_metrics()`` as ``torch_rpc_ext_agent{key="..."}``.

Every series has the label ``worker`` (this worker's name); per-peer ones
have ``peer``. A program that does not call ``serve`` gets it from the
environment: ``TORCH_RPC_EXT_METRICS_PORT=<port>`` serves on ``port +
LOCAL_RANK`` (0 without a launcher; port 0: any free port; on
``TORCH_RPC_EXT_METRICS_ADDR``, all interfaces by default) from
``init_rpc``, and the worker's endpoint is written to the store
(``torch_rpc_ext/metrics/<worker>``, within the prefix torch gives the
store of ``init_rpc``), for tools that list a group's endpoints;
``python -m torch_rpc_ext.top`` takes them as ``HOST:PORT`` arguments.

The same endpoint answers health probes (``health()``): ``/livez`` is 200
while every loop of the worker's transports runs a task within the probe's
time (``?timeout=<seconds>``, default ``HEALTH_TIMEOUT``), 503 naming the
loop that did not; ``/readyz`` is 200 while, besides, the worker's agent
serves calls (it has started, ``rpc.shutdown()`` has not passed its last
barrier, its dynamic group has not declared it dead), 503 saying why not.
Both answer JSON, as ``/calls`` does: the worker's calls in flight, oldest
first (``calls_in_flight()``: to whom, what kind, how long ago), and
``/serving``: the requests it is serving, oldest first
(``requests_being_served()``: from whom, what kind, how long ago, in what
stage, on which thread), under the ids their callers' ``/calls`` show.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterator

from torch_rpc_ext import _in_flight
from torch_rpc_ext._in_flight import CALLS_LIMIT

__all__ = ["serve", "collector", "endpoint", "health", "calls_in_flight",
           "requests_being_served"]

_PEER_COUNTERS = {
    # get_metrics() name: (family, help, labels)
    "calls_sent": ("calls", "RPC calls", {"direction": "made"}),
    "calls_served": ("calls", "RPC calls", {"direction": "served"}),
    "bytes_sent": ("bytes", "Bytes of frames on the wire", {"direction": "sent"}),
    "bytes_received": ("bytes", "Bytes of frames on the wire", {"direction": "received"}),
    "errors": ("errors", "Calls made that failed", {}),
    "timeouts": ("timeouts", "Calls made that timed out", {}),
    "rejected_frames": ("rejected_frames", "Frames from the peer refused as malformed", {}),
    "dials": ("connections", "Connections opened with the peer", {"direction": "outbound"}),
    "accepted": ("connections", "Connections opened with the peer", {"direction": "inbound"}),
    "reconnects": ("reconnects", "Connections to the peer opened after an earlier one", {}),
    "dial_failures": ("dial_failures",
                      "Connections to the peer that closed before their handshake ended", {}),
    "connections_lost": ("connection_losses",
                         "Ready connections with the peer closed for a reason, not at shutdown",
                         {}),
}
# Other counters of get_metrics(), by key: (family, help, labels); a "{}" in
# the key is a transport's or channel's name, the first label's value.
_AGENT_COUNTERS = {
    "rpc_ext.{}.tls_handshakes": ("tls_handshakes", "TLS handshakes, both ends",
                                  {"transport": None, "outcome": "ok"}),
    "rpc_ext.{}.tls_handshake_failures": ("tls_handshakes", "TLS handshakes, both ends",
                                          {"transport": None, "outcome": "failed"}),
    "rpc_ext.{}.heartbeat_timeouts": (
        "heartbeat_timeouts", "Connections closed for the peer's silence (heartbeat_timeout)",
        {"transport": None}),
    "rpc_ext.{}.unauthenticated_closed": (
        "unauthenticated_closed", "Inbound connections closed before they authenticated",
        {"transport": None}),
    "rpc_ext.{}.sources_held_off": (
        "sources_held_off", "Source addresses held off for the proofs refused from them",
        {"transport": None}),
    "rpc_ext.{}.connections_held_off": (
        "connections_held_off",
        "Inbound connections closed for their source's hold-off (unread, or at their next "
        "handshake step, proof unchecked)",
        {"transport": None}),
    "rpc_ext.{}.hold_off_exempt_failures": (
        "hold_off_exempt_failures",
        "Refused proofs from sources in hold_off_exempt (each would have counted toward a "
        "hold-off)",
        {"transport": None}),
    "rpc_ext.{}.servers_held_off": ("servers_held_off", "Servers dialed, held off for TLS "
                                    "handshakes left unfinished", {"transport": None}),
    "rpc_ext.{}.dials_held_off": ("dials_held_off", "Dials refused for their server's hold-off",
                                  {"transport": None}),
    "rpc_ext.rejected_connections": (
        "rejected_connections", "Inbound connections refused (no member, a bad handshake)", {}),
    "rpc_ext.knocks": ("knocks", "Inbound connections closed by the peer before their first "
                       "byte (a probe of the listener)", {}),
    "rpc_ext.membership.joins": ("membership_changes", "Membership changes of a dynamic group",
                                 {"change": "joined"}),
    "rpc_ext.membership.leaves": ("membership_changes", "Membership changes of a dynamic group",
                                  {"change": "left"}),
    "rpc_ext.membership.deaths": ("membership_changes", "Membership changes of a dynamic group",
                                  {"change": "declared_dead"}),
    "rpc_ext.membership.lease_lapses": (
        "lease_lapses", "Members' leases found lapsed (the member then probed)", {}),
    "rpc_ext.membership.unproven_records": ("membership_records_unproven", "Membership records "
                                            "passed over for want of the group's proof", {}),
    "rpc_ext.membership.secret_proofs_refused": ("membership_secret_proofs_refused", "Joiners' "
                                                 "proofs of the group's passphrase refused", {}),
    "rpc_ext.membership.secret_hold_offs": ("membership_secret_hold_offs", "Times no joiner was "
                                            "answered for 30 s after 8 strikes", {}),
    "rpc_ext.channel.{}.copied_bytes": ("channel_bytes", "Bytes a channel moved",
                                        {"channel": None}),
    "rpc_ext.channel.{}.segments": ("channel_segments", "Tensors' segments a channel moved",
                                    {"channel": None}),
    # (The same families for the channels that name what they sent so:
    # tcp_lanes; cuda_ring, cuda_self, cuda_staged. No channel has both.)
    "rpc_ext.channel.{}.bytes": ("channel_bytes", "Bytes a channel moved", {"channel": None}),
    "rpc_ext.channel.{}.bytes_sent": ("channel_bytes", "Bytes a channel moved",
                                      {"channel": None}),
    "rpc_ext.channel.{}.segments_sent": ("channel_segments",
                                         "Tensors' segments a channel moved", {"channel": None}),
    "rpc_ext.cuda.landed_bytes": ("cuda_landed_bytes",
                                  "Bytes of CUDA tensors received, copied into torch's memory", {}),
    "rpc_ext.cuda.landed_segments": ("cuda_landed_segments", "CUDA tensors' segments received",
                                     {}),
    "rpc_ext.cuda.landing_launches": ("cuda_landing_launches",
                                      "Copy kernel launches that landed received segments", {}),
    "rpc_ext.cuda.receive_failures": (
        "cuda_receive_failures", "Messages whose CUDA tensors could not land here", {}),
    "rpc_ext.late_responses": ("late_responses", "Responses that came after their call ended",
                               {}),
    "rpc_ext.trace_contexts_ignored": (
        "trace_contexts_ignored", "Trace contexts from peers ignored as malformed", {}),
}
# tcp_lanes' listener holds sources off as the transports' do: the same
# families, its name the transport label's value.
_AGENT_COUNTERS.update({
    f"rpc_ext.channel.{{}}.{what}": _AGENT_COUNTERS[f"rpc_ext.{{}}.{what}"]
    for what in ("sources_held_off", "hold_off_exempt_failures")})
_HISTOGRAMS = {
    # _call_costs() metric: (family, help, extra labels)
    "call_seconds": ("call_duration_seconds",
                     "Calls made: from the request sent to its response received", {}),
    "queue_seconds": ("serve_queue_seconds",
                      "Calls served: from the request read to its function started", {}),
    "serve_seconds": ("serve_duration_seconds",
                      "Calls served: from the function started to the response queued", {}),
    "request_bytes": ("request_bytes", "Request frames' bytes", {"direction": "made"}),
    "served_request_bytes": ("request_bytes", "Request frames' bytes", {"direction": "served"}),
    "response_bytes": ("response_bytes", "Response frames' bytes", {"direction": "made"}),
    "served_response_bytes": ("response_bytes", "Response frames' bytes",
                              {"direction": "served"}),
}
_PREFIX = "torch_rpc_ext_"


def _agent_counter(key: str):
    """(family, help, labels) for a key of _AGENT_COUNTERS, with the name a
    "{}" stands for filled in; None for another key."""
    spec = _AGENT_COUNTERS.get(key)
    if spec is not None:
        return spec
    head, _, tail = key.rpartition(".")
    for prefix in ("rpc_ext.channel.", "rpc_ext."):
        if head.startswith(prefix) and "." not in head[len(prefix):]:
            spec = _AGENT_COUNTERS.get(f"{prefix}{{}}.{tail}")
            if spec is not None:
                family, help_text, labels = spec
                first = next(iter(labels))
                return family, help_text, {**labels, first: head[len(prefix):]}
    return None
_STORE_KEY = "torch_rpc_ext/metrics/"


def _prometheus():
    try:
        import prometheus_client  # noqa: F401
        from prometheus_client import core
    except ImportError as e:
        raise ImportError(
            "torch_rpc_ext.metrics needs prometheus_client: "
            "pip install 'torch_rpc_ext[metrics]' (or pip install prometheus_client)"
        ) from e
    return core


def _agent():
    from torch.distributed.rpc import api

    try:
        return api._get_current_rpc_agent()
    except RuntimeError:
        return None  # not initialised, or shut down


class _Collector:
    """Reads the current agent at each scrape (prometheus_client's custom
    collector protocol)."""

    def describe(self):
        return []  # families depend on the peers: no registration-time check

    def collect(self) -> Iterator[Any]:
        core = _prometheus()
        agent = _agent()
        if agent is None or not hasattr(agent, "_call_costs"):
            return
        worker = agent.get_worker_info().name
        metrics = agent.get_metrics()
        families: dict[str, Any] = {}

        def counter(name, help_text, labels):
            fam = families.get(name)
            if fam is None:
                fam = families[name] = core.CounterMetricFamily(
                    _PREFIX + name, help_text, labels=labels)
            return fam

        peer_prefix = "rpc_ext.peer."
        gauges = core.GaugeMetricFamily(
            _PREFIX + "agent", "Other values of the agent's get_metrics()",
            labels=["worker", "key"])
        in_flight = core.GaugeMetricFamily(
            _PREFIX + "calls_in_flight", "Calls made to the peer and not yet answered",
            labels=["worker", "peer"])
        oldest = core.GaugeMetricFamily(
            _PREFIX + "oldest_call_age_seconds",
            "How long the oldest call in flight to the peer has waited (0: none)",
            labels=["worker", "peer"])
        for key, value in sorted(metrics.items()):
            if key == "rpc_ext.oldest_request_ms":
                continue  # its own gauge below
            if key.startswith(peer_prefix):
                peer, _, what = key[len(peer_prefix):].rpartition(".")
                if what == "in_flight" and peer:
                    in_flight.add_metric([worker, peer], float(value))
                    continue
                if what == "oldest_call_ms" and peer:
                    oldest.add_metric([worker, peer], float(value) / 1000)
                    continue
                spec = _PEER_COUNTERS.get(what)
                if spec is not None and peer:
                    family, help_text, extra = spec
                    labels = ["worker", "peer", *extra]
                    counter(family, help_text, labels).add_metric(
                        [worker, peer, *extra.values()], float(value))
                    continue
            try:
                number = float(value)
            except ValueError:
                continue
            spec = _agent_counter(key)
            if spec is not None:
                family, help_text, extra = spec
                counter(family, help_text, ["worker", *extra]).add_metric(
                    [worker, *extra.values()], number)
                continue
            gauges.add_metric([worker, key], number)
        for fam in families.values():
            yield fam
        yield in_flight
        yield oldest
        serving = core.GaugeMetricFamily(
            _PREFIX + "serving", "Calls being served", labels=["worker"])
        serving.add_metric([worker], float(metrics.get("agent.server_active_calls", 0)))
        yield serving
        oldest_request = core.GaugeMetricFamily(
            _PREFIX + "oldest_request_age_seconds",
            "Seconds since the oldest request being served was read (0: none)",
            labels=["worker"])
        oldest_request.add_metric(
            [worker], float(metrics.get("rpc_ext.oldest_request_ms", 0)) / 1000)
        yield oldest_request
        idle = core.GaugeMetricFamily(
            _PREFIX + "idle_threads", "Idle threads of the agent's pool", labels=["worker"])
        idle.add_metric([worker], float(metrics.get("agent.num_idle_threads", 0)))
        yield idle
        yield gauges

        histograms: dict[str, Any] = {}
        for peer, kind, metric, bounds, counts, total in agent._call_costs():
            spec = _HISTOGRAMS.get(metric)
            if spec is None:
                continue
            family, help_text, extra = spec
            fam = histograms.get(family)
            if fam is None:
                fam = histograms[family] = core.HistogramMetricFamily(
                    _PREFIX + family, help_text,
                    labels=["worker", "peer", "kind", *extra])
            cumulative, buckets = 0, []
            for bound, count in zip([*bounds, float("inf")], counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)),
                                float(cumulative)))
            fam.add_metric([worker, peer, kind, *extra.values()], buckets, total)
        yield from histograms.values()


_lock = threading.Lock()
_served: dict[str, Any] = {}


def collector() -> _Collector:
    """The collector ``serve`` registers: for a registry of one's own
    (``registry.register(torch_rpc_ext.metrics.collector())``)."""
    _prometheus()
    return _Collector()


# Scrapers served at once (a thread each), and how long one may take to send
# its request or read the answer: more are closed on arrival, a slower one
# is dropped (prometheus_client's own server keeps a thread per connection
# for as long as the client keeps it open, however many).
MAX_CLIENTS = 64
CLIENT_TIMEOUT = 10.0


def _server_classes():
    import socket
    import socketserver
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    class Handler(WSGIRequestHandler):
        timeout = CLIENT_TIMEOUT  # the socket's, for each read and write

        def log_message(self, format, *args):  # noqa: A002 (a scrape is no news)
            pass

    class Server(socketserver.ThreadingMixIn, WSGIServer):
        daemon_threads = True
        block_on_close = False
        request_queue_size = 128  # (socketserver's 5 left clients in SYN retries)

        def __init__(self, address, handler):
            if ":" in address[0]:
                self.address_family = socket.AF_INET6
            self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
            super().__init__(address, handler)

        def process_request(self, request, client_address):
            if not self._slots.acquire(blocking=False):
                self.shutdown_request(request)  # over the cap: closed at once
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self._slots.release()
                raise

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self._slots.release()

        def handle_error(self, request, client_address):
            pass  # a client gone or too slow: nothing to report

    return Server, Handler


# How long a health probe waits for each loop to run its task, by default.
HEALTH_TIMEOUT = 5.0


def health(timeout: float = HEALTH_TIMEOUT) -> dict:
    """This worker's health, as ``/livez`` and ``/readyz`` report it:
    ``live`` (every loop of its transports ran a task posted now within
    ``timeout`` seconds: none blocks), ``ready`` (live, and its agent serves
    calls), ``why`` (what makes it not live or not ready, "" if both),
    ``worker`` (its name, None without an agent) and ``loops`` (transport:
    seconds its loop took, None if it did not within ``timeout``). A process
    without an agent (before ``init_rpc`` returns, after ``rpc.shutdown()``)
    is live and not ready. Waits up to ``timeout`` seconds."""
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= 60:
        raise ValueError(f"health(timeout={timeout!r}): seconds, more than 0, at most 60")
    agent = _agent()
    if why := _in_flight.not_ours(agent, "_health"):
        return {"live": True, "ready": False, "why": why, "worker": None, "loops": {}}
    worker = agent.get_worker_info().name
    not_serving, probed = agent._health(float(timeout))
    loops = {name: (us / 1e6 if us >= 0 else None) for name, us in probed}
    stuck = [name for name, took in loops.items() if took is None]
    live = not stuck
    why = ""
    if stuck:
        why = (f"the loop of {', '.join(stuck)} did not run a task within {timeout:g} s: "
               f"a handler blocks it (its peers' pings go unanswered too; they close "
               f"its connections after heartbeat_timeout)")
    if not_serving:
        why = not_serving + (f"; {why}" if why else "")
    return {"live": live, "ready": live and not not_serving, "why": why,
            "worker": worker, "loops": loops}


def _health_answer(path: str, environ: dict) -> tuple[str, bytes]:
    """The status line and JSON body of /livez or /readyz."""
    import json
    from urllib.parse import parse_qs

    query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    timeout = HEALTH_TIMEOUT
    if "timeout" in query:
        text = query["timeout"][-1]
        try:
            timeout = float(text)
            if not 0 < timeout <= 60:
                raise ValueError
        except ValueError:
            body = {"why": f"timeout={text!r} is not a number of seconds, more than 0, "
                           f"at most 60"}
            return "400 Bad Request", json.dumps(body).encode()
    state = health(timeout)
    ok = state["live"] if path == "/livez" else state["ready"]
    return ("200 OK" if ok else "503 Service Unavailable"), json.dumps(state).encode()


def calls_in_flight(limit: int = CALLS_LIMIT) -> dict:
    """What this worker waits on: ``calls`` (its calls in flight, oldest
    first, at most ``limit``; each ``id``, ``to`` (the callee), ``kind``
    (``script``, ``python``, ``rref``, ``autograd``, ``other``), ``age``
    (seconds since it was sent) and ``timeout`` (seconds; None: never
    expires)), ``in_flight`` (how many in all), ``worker`` (its name, None
    without an agent) and ``why`` (why none are listed: no agent, or another
    backend's; "" otherwise). As the endpoint's ``/calls?limit=`` answers."""
    return _in_flight.calls_in_flight(_agent(), limit)


def requests_being_served(limit: int = CALLS_LIMIT) -> dict:
    """What this worker holds: ``requests`` (the requests it is serving,
    oldest first, at most ``limit``; each ``id`` (its caller's, as the
    caller's ``calls_in_flight()`` shows it), ``from`` (the caller),
    ``kind`` (as ``calls_in_flight``'s), ``age`` (seconds since it was
    read), ``stage`` (``queued``: read, not yet started; ``running``: in its
    function; ``waiting``: its function returned a future not yet complete
    (an ``@rpc.functions.async_execution`` one's), or its RRef arguments
    await their owner's confirmation before it runs; ``responding``: its
    answer is being written) and ``thread``
    (the Linux id of the thread running it or writing its answer, as
    ``threading.get_native_id()`` and gdb's ``info threads`` show it;
    None while queued or waiting)), ``serving`` (how many in all), ``worker`` and
    ``why`` (as ``calls_in_flight``'s). As the endpoint's
    ``/serving?limit=`` answers."""
    return _in_flight.requests_being_served(_agent(), limit)


def _app(metrics_app):
    """The endpoint's WSGI application: health probes at /livez and
    /readyz, calls in flight at /calls, requests being served at /serving,
    the metrics everywhere else (as prometheus_client serves them)."""

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path not in ("/livez", "/readyz", "/calls", "/serving"):
            return metrics_app(environ, start_response)
        if path in ("/calls", "/serving"):
            status, body = _in_flight.answer(_agent(), environ, path)
        else:
            status, body = _health_answer(path, environ)
        start_response(status, [("Content-Type", "application/json"),
                                ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-store")])
        return [body]

    return app


def serve(port: int = 0, addr: str = "0.0.0.0") -> int:
    """Serves this worker's metrics at ``http://<addr>:<port>/metrics``, its
    health at ``/livez`` and ``/readyz`` (``health()``), its calls in flight
    at ``/calls`` and the requests it is serving at ``/serving``, from a thread of
    its own; returns the port (``port=0``: a free one). Once per
    process: a second call returns the first's port. At most MAX_CLIENTS
    scrapers at once, each given CLIENT_TIMEOUT seconds per read or write."""
    core = _prometheus()
    import prometheus_client

    with _lock:
        if "port" in _served:
            return _served["port"]
        registry = core.CollectorRegistry(auto_describe=False)
        registry.register(_Collector())
        server_class, handler_class = _server_classes()
        try:
            server = server_class((addr, port), handler_class)
        except OSError as e:
            raise OSError(
                e.errno, f"torch_rpc_ext.metrics cannot serve on {addr}:{port}: {e.strerror}"
            ) from e
        server.set_app(_app(prometheus_client.make_wsgi_app(registry)))
        thread = threading.Thread(
            target=server.serve_forever, name="rpcx-metrics", daemon=True)
        thread.start()
        _served.update(port=server.server_port, server=server, thread=thread)
        return server.server_port


def _forget_in_child() -> None:
    # A forked child has no server thread: its serve() starts its own (on
    # another port: the parent's socket is still bound). Its lock is new too:
    # the parent's may have been held by a thread the child does not have.
    global _lock
    _lock = threading.Lock()
    _served.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def endpoint() -> int | None:
    """The port ``serve`` serves on in this process, or None."""
    return _served.get("port")


def port_from_env() -> int | None:
    """The port ``TORCH_RPC_EXT_METRICS_PORT`` asks for (plus LOCAL_RANK;
    0: any free one), None if unset; ValueError naming a bad value."""
    value = os.environ.get("TORCH_RPC_EXT_METRICS_PORT", "").strip()
    if not value:
        return None
    try:
        base = int(value)
        if not 0 <= base <= 65535:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"TORCH_RPC_EXT_METRICS_PORT={value!r} is not a port (0 to 65535; 0: any free one)"
        ) from None
    if not base:
        return 0
    rank = os.environ.get("LOCAL_RANK", "0").strip() or "0"
    try:
        local = int(rank)
        if local < 0 or base + local > 65535:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"TORCH_RPC_EXT_METRICS_PORT={value!r} plus LOCAL_RANK={rank!r} is not a "
            f"port (each local rank serves on the base port plus its LOCAL_RANK, at "
            f"most 65535)"
        ) from None
    return base + local


def serve_env_port(port: int) -> int:
    """Serves on the port ``TORCH_RPC_EXT_METRICS_PORT`` asks for (called
    by ``init_rpc`` with port_from_env(), before anything else starts), on
    ``TORCH_RPC_EXT_METRICS_ADDR`` (default all interfaces); a port taken
    fails naming the variables, before this worker's rendezvous."""
    addr = os.environ.get("TORCH_RPC_EXT_METRICS_ADDR", "").strip() or "0.0.0.0"
    try:
        return serve(port, addr=addr)
    except OSError as e:
        raise OSError(
            e.errno,
            f"TORCH_RPC_EXT_METRICS_PORT="
            f"{os.environ.get('TORCH_RPC_EXT_METRICS_PORT', '')!r} with LOCAL_RANK="
            f"{os.environ.get('LOCAL_RANK', '0')!r}: cannot serve metrics on "
            f"{addr}:{port}: {e.strerror or e} (each worker of a host needs a port of its "
            f"own: a launcher that sets LOCAL_RANK, or port 0 for any free one)",
        ) from e


def serve_from_env(store: Any, name: str, port: int) -> None:
    """``TORCH_RPC_EXT_METRICS_PORT``: serve (serve_env_port), and write
    ``host:port`` to the store under ``torch_rpc_ext/metrics/<worker>`` (in
    the store ``init_rpc`` was given, within torch's prefix for it)."""
    port = serve_env_port(port)
    from torch_rpc_ext._C import default_address

    host = os.environ.get("TORCH_RPC_EXT_METRICS_HOST") or default_address()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address, as a URL writes it
    store.set(_STORE_KEY + name, f"{host}:{port}")
