# SPDX-License-Identifier: BSD-3-Clause
"""torch_rpc_ext.tracing (issue 47): OpenTelemetry traces across the RPC
boundary, with the SDK's in-memory exporter in the caller and the callee:
one trace id across both, parents right, for sync, async, remote, nested
and failing calls; a garbage trace context from a peer ignored and
counted."""

import pytest
import torch
from torch.distributed import rpc

from tests.rpc.world import init, run_world

pytest.importorskip("opentelemetry.sdk", reason="needs opentelemetry-sdk")

pytestmark = pytest.mark.timeout(180)


def double(x):
    return x * 2


def fails(x):
    raise ValueError(f"no {x}")


@torch.jit.script
def script_triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@torch.jit.script
def script_fetch(r: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return r.to_here() + 1


def nested(x):
    # On worker1, under its server span: a call back to worker0.
    return rpc.rpc_sync("worker0", double, args=(x,)) + 1


def traced(rank, world_size, garbage=False):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    init(rank, world_size)
    out = {}
    if rank == 0:
        tracer = trace.get_tracer("test")
        with tracer.start_as_current_span("step"):
            out["sync"] = rpc.rpc_sync("worker1", double, args=(1,))
            out["async"] = rpc.rpc_async("worker1", double, args=(2,)).wait()
            out["remote"] = rpc.remote("worker1", double, args=(3,)).to_here()
            out["nested"] = rpc.rpc_sync("worker1", nested, args=(4,))
            try:
                rpc.rpc_sync("worker1", fails, args=(5,))
            except ValueError as e:
                out["failed"] = str(e)
            one = torch.ones(2)
            out["builtin"] = rpc.rpc_sync("worker1", torch.add, args=(one, one)).tolist()
            out["script"] = rpc.rpc_sync("worker1", script_triple, args=(one,)).tolist()
            # An RRef among a TorchScript function's arguments: its request
            # was once decoded twice to name the span, forking the RRef
            # twice (the copy's delete reached us first: the fetch waited
            # for ever).
            try:
                out["script_rref"] = rpc.rpc_sync(
                    "worker1", script_fetch, args=(rpc.RRef(one),), timeout=15).tolist()
            except RuntimeError as e:
                out["script_rref"] = str(e)
        # Outside any span: nothing carried, no client span.
        out["untraced"] = rpc.rpc_sync("worker1", double, args=(6,))
        if garbage:
            from torch_rpc_ext import _C

            _C._set_trace_outgoing("00-not-a-traceparent")
            out["garbage"] = rpc.rpc_sync("worker1", double, args=(7,))
            _C._set_trace_outgoing("")
    rpc.api._barrier(["worker0", "worker1"])
    out["ignored"] = int(rpc.api._get_current_rpc_agent().get_metrics()[
        "rpc_ext.trace_contexts_ignored"])
    rpc.shutdown()
    out["spans"] = [
        {"name": s.name, "trace": s.context.trace_id, "id": s.context.span_id,
         "parent": s.parent.span_id if s.parent else None, "kind": s.kind.name,
         "error": s.status.status_code.name == "ERROR", "start": s.start_time,
         "end": s.end_time}
        for s in exporter.get_finished_spans()]
    return out


def by_name(spans, name):
    found = [s for s in spans if s["name"] == name]
    return found


def test_one_trace_across_caller_and_callee():
    out = run_world(traced, 2, timeout=150)
    caller, callee = out[0], out[1]
    assert caller["sync"] == 2 and caller["async"] == 4 and caller["remote"] == 6
    assert caller["nested"] == 9 and "no 5" in caller["failed"] and caller["untraced"] == 12
    step = by_name(caller["spans"], "step")[0]
    calls = by_name(caller["spans"], "rpc.call double")
    # sync, async, remote (each a client span, children of the step); the
    # untraced call made none.
    assert len(calls) == 3
    assert all(c["trace"] == step["trace"] and c["parent"] == step["id"] for c in calls)
    assert all(c["kind"] == "CLIENT" for c in calls)
    # Under each client span, the agent's encode, then its send, inside it.
    for call in calls:
        encode = [s for s in by_name(caller["spans"], "rpc.encode") if s["parent"] == call["id"]]
        send = [s for s in by_name(caller["spans"], "rpc.send") if s["parent"] == call["id"]]
        assert len(encode) == 1 and len(send) == 1, (call, caller["spans"])
        assert call["start"] <= encode[0]["start"] <= encode[0]["end"] == send[0]["start"]
        assert send[0]["start"] <= send[0]["end"] <= call["end"]
        assert encode[0]["trace"] == send[0]["trace"] == step["trace"]
    # Every traced call has its pair; untraced ones (the barrier's) none.
    traced_calls = [s for s in caller["spans"] if s["name"].startswith("rpc.call")]
    assert len(by_name(caller["spans"], "rpc.encode")) == len(traced_calls)
    serves = by_name(callee["spans"], "rpc.serve double")
    # Each served under its client span, in the caller's trace; the
    # untraced call (and the barrier's) under none.
    assert len(serves) == 3
    assert {s["parent"] for s in serves} == {c["id"] for c in calls}
    assert all(s["trace"] == step["trace"] and s["kind"] == "SERVER" for s in serves)
    # Nested: step -> call nested -> serve nested (worker1) -> call double
    # (worker1) -> serve double (worker0).
    call_nested = by_name(caller["spans"], "rpc.call nested")[0]
    serve_nested = by_name(callee["spans"], "rpc.serve nested")[0]
    assert serve_nested["parent"] == call_nested["id"]
    inner_call = [s for s in by_name(callee["spans"], "rpc.call double")
                  if s["parent"] == serve_nested["id"]]
    assert len(inner_call) == 1 and inner_call[0]["trace"] == step["trace"]
    inner_serve = [s for s in by_name(caller["spans"], "rpc.serve double")
                   if s["parent"] == inner_call[0]["id"]]
    assert len(inner_serve) == 1 and inner_serve[0]["trace"] == step["trace"]
    # A builtin operator and a TorchScript function: served under spans
    # made from C++, named by the operator and the function.
    assert caller["builtin"] == [2.0, 2.0] and caller["script"] == [3.0, 3.0]
    assert caller["script_rref"] == [2.0, 2.0], caller["script_rref"]
    for call_name, serve_name in (("rpc.call add", "rpc.serve aten::add"),
                                  ("rpc.call " + script_triple.qualified_name,
                                   "rpc.serve " + script_triple.qualified_name),
                                  ("rpc.call " + script_fetch.qualified_name,
                                   "rpc.serve " + script_fetch.qualified_name)):
        call = by_name(caller["spans"], call_name)
        serve = by_name(callee["spans"], serve_name)
        assert len(call) == 1 and len(serve) == 1, (call_name, callee["spans"])
        assert serve[0]["parent"] == call[0]["id"] and serve[0]["trace"] == step["trace"]
        assert serve[0]["kind"] == "SERVER"
    # The failing call: an error on both sides.
    assert by_name(caller["spans"], "rpc.call fails")[0]["error"]
    assert by_name(callee["spans"], "rpc.serve fails")[0]["error"]
    assert callee["ignored"] == 0


def test_a_garbage_trace_context_is_ignored_and_counted():
    out = run_world(traced, 2, timeout=150, garbage=True)
    assert out[0]["garbage"] == 14  # the call itself is served
    assert out[1]["ignored"] == 1
    # No server span came of it: four traced double calls served, as above.
    assert len(by_name(out[1]["spans"], "rpc.serve double")) == 3
