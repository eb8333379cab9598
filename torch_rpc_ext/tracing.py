# SPDX-License-Identifier: BSD-3-Clause
"""OpenTelemetry traces across the RPC boundary (docs/observability.md).

Where OpenTelemetry's API is installed and a tracer provider is configured
(the SDK's, or any real one) when ``init_rpc`` runs, each call made while a
span is current becomes a client span (``rpc.call <function>``), and its
context travels with the request (a W3C ``traceparent`` at the end of the
message head: docs/wire-format.md). The callee runs a Python function under
a server span (``rpc.serve <function>``) that is that span's child, so one
trace holds both sides (the client span's other children, ``rpc.encode``
and ``rpc.send``, are the agent building the frame and handing it to the
connection), and calls the function makes go on in the same
trace. Nothing is carried, and nothing costs beyond a check, when no
provider is configured or no span is current. ``TORCH_RPC_EXT_TRACING=0``
turns it off. A peer's trace context that is not a traceparent is ignored
and counted (``rpc_ext.trace_contexts_ignored``), never trusted further.

A builtin operator or TorchScript function is served under a server span
too (``rpc.serve aten::add``, ``rpc.serve <qualified name>``), made from
C++ through a hook that takes the GIL only when a trace context came with
the request; calls TorchScript makes do not carry it on (no Python context
there).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["enable", "enabled"]

_state: dict[str, Any] = {}


def enabled() -> bool:
    return bool(_state.get("on"))


def _configured() -> bool:
    """OpenTelemetry's API is loaded and a provider is set (not the proxy or
    no-op one that stand in until an SDK is configured). A program that
    configured one has imported it: nothing is imported here otherwise."""
    import sys

    if "opentelemetry.trace" not in sys.modules:
        return False
    from opentelemetry import trace
    provider = trace.get_tracer_provider()
    return type(provider).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider")


def enable_if_configured() -> None:
    """Called by init_rpc (before the agent starts)."""
    if os.environ.get("TORCH_RPC_EXT_TRACING", "").strip() == "0":
        return
    if _configured():
        enable()


def _name_of(func: Any) -> str:
    """A TorchScript function's qualified name, a builtin operator's name
    (torch.add: "add"), else the function's qualified name."""
    import types

    qualified = getattr(func, "qualified_name", None)
    if isinstance(qualified, str) and qualified:
        return qualified
    if isinstance(func, types.BuiltinFunctionType):
        return func.__name__
    for attr in ("__qualname__", "__name__", "name"):
        value = getattr(func, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(func).__name__


def enable() -> None:
    """Trace calls from now on (idempotent). The callee side needs it before
    this process's first ``init_rpc``: torch caches the function that runs
    Python calls when its RPC starts."""
    if _state.get("on"):
        return
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,
    )
    from torch.distributed import rpc
    from torch.distributed.rpc import api, internal

    from torch_rpc_ext import _C

    tracer = trace.get_tracer("torch_rpc_ext")
    propagator = TraceContextTextMapPropagator()

    def traceparent() -> str:
        carrier: dict[str, str] = {}
        propagator.inject(carrier)
        return carrier.get("traceparent", "")

    def client(to: Any, func: Any, send):
        """Send under a client span when a span is current; the span ends
        when the call's future completes."""
        if not trace.get_current_span().get_span_context().is_valid:
            return send(), None
        peer = to if isinstance(to, str) else getattr(to, "name", str(to))
        span = tracer.start_span(f"rpc.call {_name_of(func)}", kind=SpanKind.CLIENT,
                                 attributes={"rpc.system": "torch_rpc_ext",
                                             "rpc.method": _name_of(func),
                                             "peer.service": str(peer)})
        with trace.use_span(span, end_on_exit=False):
            _C._take_send_phases()  # none left from an untraced send
            _C._set_trace_outgoing(traceparent())
            try:
                result = send()
                phases(_C._take_send_phases())
            except BaseException as e:
                span.record_exception(e)
                span.set_status(Status(StatusCode.ERROR, str(e)))
                span.end()
                raise
            finally:
                _C._set_trace_outgoing("")
        return result, span

    def phases(times) -> None:
        """The agent's encode and send of the call, children of its client
        span (under use_span), from the times the agent took."""
        if times is None:
            return
        encode_start, encode_end, send_end = times
        tracer.start_span("rpc.encode", start_time=encode_start).end(end_time=encode_end)
        if send_end:
            tracer.start_span("rpc.send", start_time=encode_end).end(end_time=send_end)

    def landed(times) -> None:
        """The request's CUDA tensors landing here (copies into torch's
        memory enqueued before the function ran), a child of the current
        server span."""
        if times is not None:
            tracer.start_span("rpc.land", start_time=times[0]).end(end_time=times[1])

    def finish(span, fut) -> None:
        def done(f):
            try:
                f.value()
            except BaseException as e:  # noqa: BLE001 - the call's failure
                span.record_exception(e)
                span.set_status(Status(StatusCode.ERROR, str(e)))
            span.end()

        fut.add_done_callback(done)

    # What this wraps, in a list: an init of ours puts its own _invoke_rpc
    # there (_torch_private.install_builtin_frontend), under the span.
    inner = [api._invoke_rpc]

    def _invoke_rpc(to, func, rpc_type, args=None, kwargs=None, rpc_timeout=-1.0):
        fut, span = client(to, func, lambda: inner[0](
            to, func, rpc_type, args, kwargs, rpc_timeout))
        if span is not None:
            finish(span, fut)
        return fut

    _invoke_rpc._torch_rpc_ext_inner = inner  # type: ignore[attr-defined]

    original_remote = api.remote

    def remote(to, func, args=None, kwargs=None, timeout=-1.0):
        rref, span = client(to, func, lambda: original_remote(to, func, args, kwargs, timeout))
        if span is not None:
            finish(span, rref._get_future())
        return rref

    remote.__doc__ = original_remote.__doc__
    original_run = internal._run_function

    def _run_function(python_udf):
        incoming = _C._trace_incoming()
        if not incoming:
            return original_run(python_udf)
        context = propagator.extract({"traceparent": incoming})
        name = _name_of(getattr(python_udf, "func", python_udf))
        with tracer.start_as_current_span(
                f"rpc.serve {name}", context=context, kind=SpanKind.SERVER,
                attributes={"rpc.system": "torch_rpc_ext", "rpc.method": name}) as span:
            landed(_C._trace_incoming_landing())
            result = original_run(python_udf)
            if isinstance(result, internal.RemoteException):
                span.set_status(Status(StatusCode.ERROR, result.msg.splitlines()[0]
                                       if result.msg else "remote exception"))
            return result

    def begin_serve(incoming: str, name: str):
        """A builtin operator's or TorchScript function's span (called from
        C++: no Python runs them)."""
        context = propagator.extract({"traceparent": incoming})
        span = tracer.start_span(f"rpc.serve {name}", context=context, kind=SpanKind.SERVER,
                                 attributes={"rpc.system": "torch_rpc_ext", "rpc.method": name})
        with trace.use_span(span, end_on_exit=False):
            landed(_C._trace_incoming_landing())
        return span

    def end_serve(span, error: str) -> None:
        if error:
            span.set_status(Status(StatusCode.ERROR, error.splitlines()[0]))
        span.end()

    api._invoke_rpc = _invoke_rpc
    api.remote = rpc.remote = remote
    internal._run_function = _run_function
    _C._set_trace_serve_hook(begin_serve, end_serve)
    _state["on"] = True
