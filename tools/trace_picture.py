# SPDX-License-Identifier: BSD-3-Clause
"""Draws one traced parameter-server step as an SVG (docs/observability.md).

A trainer and two parameter servers on TORCH_RPC_EXT, each with
OpenTelemetry's SDK and its in-memory exporter; the trainer runs one step
under a span: it fetches both servers' parameters at once (``rpc_async``),
computes, and pushes its gradients to each (``rpc_sync``). Every process's
spans come back to the parent, which draws them on one time axis (one host:
one clock), a row a span, indented under its parent, coloured by process.

    python tools/trace_picture.py [--out docs/trace-ps-step.svg]

Needs opentelemetry-sdk (``pip install 'torch_rpc_ext[tracing]'``).
"""

import argparse
import os
import time

import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

import torch_rpc_ext  # registers the backend

NAMES = ["trainer", "ps0", "ps1"]
COLOURS = {"trainer": "#4c78a8", "ps0": "#f58518", "ps1": "#54a24b"}
PARAMS = {}


def get_params(n):
    PARAMS.setdefault("w", torch.randn(n))
    return PARAMS["w"]


def push_grads(g):
    time.sleep(0.002)  # the server's update
    PARAMS["w"] = PARAMS["w"] - 0.1 * g
    return True


def worker(rank, port, spans):
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(NAMES[rank], rank=rank, world_size=3, backend=rpc.BackendType.TORCH_RPC_EXT)
    if rank == 0:
        tracer = trace.get_tracer("trace_picture")
        for _ in range(3):  # warm up: connections, caches
            rpc.rpc_sync("ps0", get_params, args=(1 << 16,))
            rpc.rpc_sync("ps1", get_params, args=(1 << 16,))
        exporter.clear()
        with tracer.start_as_current_span("train step"):
            futs = [rpc.rpc_async(ps, get_params, args=(1 << 16,)) for ps in ("ps0", "ps1")]
            params = [f.wait() for f in futs]
            with tracer.start_as_current_span("forward + backward"):
                grads = [torch.tanh(p) * 0.01 for p in params]
                time.sleep(0.003)
            for ps, g in zip(("ps0", "ps1"), grads):
                rpc.rpc_sync(ps, push_grads, args=(g,))
    rpc.api._barrier(NAMES)
    spans.put([(NAMES[rank], s.name, s.context.span_id, s.parent.span_id if s.parent else None,
                s.start_time, s.end_time) for s in exporter.get_finished_spans()])
    rpc.shutdown()


def draw(spans, path):
    by_id = {s[2]: s for s in spans}
    # The step's tree, depth first, children by start.
    children = {}
    for s in spans:
        children.setdefault(s[3] if s[3] in by_id else None, []).append(s)
    rows = []

    def walk(parent, depth):
        for s in sorted(children.get(parent, []), key=lambda s: s[4]):
            rows.append((depth, s))
            walk(s[2], depth + 1)

    walk(None, 0)
    t0 = min(s[4] for s in spans)
    t1 = max(s[5] for s in spans)
    width, left, row_h, top = 900, 260, 22, 40
    scale = (width - left - 20) / max(1, t1 - t0)
    height = top + row_h * len(rows) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="14">One parameter-server step on TORCH_RPC_EXT: '
           f'{(t1 - t0) / 1e6:.2f} ms, {len(rows)} spans from 3 processes, one trace</text>']
    for i, (depth, (proc, name, *_rest, start, end)) in enumerate(rows):
        y = top + i * row_h
        x = left + (start - t0) * scale
        w = max(1.5, (end - start) * scale)
        out.append(f'<text x="{10 + 14 * depth}" y="{y + 14}">{name} '
                   f'<tspan fill="#777">({proc})</tspan></text>')
        out.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 8}" '
                   f'fill="{COLOURS[proc]}"/>')
        label = f"{(end - start) / 1e3:.0f} us"
        if x + w + 70 > width:  # no room on the right: inside the bar's end
            out.append(f'<text x="{x + w - 4:.1f}" y="{y + 14}" fill="white" '
                       f'text-anchor="end">{label}</text>')
        else:
            out.append(f'<text x="{x + w + 4:.1f}" y="{y + 14}" fill="#555">{label}</text>')
    axis_y = top + row_h * len(rows) + 15
    for k in range(6):
        x = left + k * (width - left - 20) / 5
        ms = k * (t1 - t0) / 5 / 1e6
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{axis_y - 10}" '
                   'stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 5}" text-anchor="middle">{ms:.2f} ms</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("docs", "trace-ps-step.svg"))
    args = parser.parse_args()
    port = torch_rpc_ext.free_port()
    ctx = mp.get_context("spawn")
    spans = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, spans)) for r in range(3)]
    for p in procs:
        p.start()
    collected = []
    for _ in procs:
        collected += spans.get(timeout=120)
    for p in procs:
        p.join(60)
    traces = {s[2] for s in collected}
    assert collected and traces, "no spans came back"
    rows = draw(collected, args.out)
    for depth, (proc, name, *_rest, start, end) in rows:
        print(f"{'  ' * depth}{name} ({proc}): {(end - start) / 1e3:.0f} us")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
