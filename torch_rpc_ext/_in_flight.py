# SPDX-License-Identifier: BSD-3-Clause
"""What a worker waits on, and what it holds: its calls in flight, oldest
first (``torch_rpc_ext.metrics.calls_in_flight`` and the metrics endpoint's
``/calls``; docs/observability.md, "Calls in flight"), and the requests it
is serving, oldest first (``requests_being_served`` and ``/serving``;
"Requests being served").

A job that hangs is most often a worker waiting on a call that another
worker never answers; each worker's oldest calls say which peer, what kind
of call and for how long, as NCCL's flight recorder does for collectives;
the callee's requests say, under the same ids, what became of each: queued,
running on which thread, waiting on a future, or being answered.
"""

from __future__ import annotations

import json
import re
from typing import Any

CALLS_LIMIT = 20
MAX_CALLS_LIMIT = 1000


def _check_limit(limit: Any, what: str = "calls_in_flight", noun: str = "calls") -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CALLS_LIMIT:
        raise ValueError(
            f"{what}(limit={limit!r}): a whole number of {noun}, 1 to {MAX_CALLS_LIMIT}")
    return limit


def not_ours(agent: Any, method: str) -> str:
    """Why ``agent`` (the current RPC agent, or None) cannot be asked
    through ``method`` of TORCH_RPC_EXT's agent (health probes, calls in
    flight): "" if it can."""
    if agent is None:
        return ("no RPC agent in this process: init_rpc has not returned, or "
                "rpc.shutdown() has run")
    if not hasattr(agent, method):
        return f"the current RPC agent is not TORCH_RPC_EXT's ({type(agent).__name__})"
    return ""


def calls_in_flight(agent: Any, limit: int = CALLS_LIMIT) -> dict:
    """``agent``'s calls in flight (see metrics.calls_in_flight)."""
    limit = _check_limit(limit)
    if why := not_ours(agent, "_calls_in_flight"):
        return {"worker": None, "in_flight": 0, "calls": [], "why": why}
    oldest, total = agent._calls_in_flight(limit)
    calls = [{"id": call_id, "to": to, "kind": kind, "age": round(age, 6),
              # 0 on the wire: the call never expires.
              "timeout": timeout if timeout != 0 else None}
             for call_id, to, kind, age, timeout in oldest]
    return {"worker": agent.get_worker_info().name, "in_flight": total, "calls": calls,
            "why": ""}


def requests_being_served(agent: Any, limit: int = CALLS_LIMIT) -> dict:
    """``agent``'s requests being served (see metrics.requests_being_served)."""
    limit = _check_limit(limit, "requests_being_served", "requests")
    if why := not_ours(agent, "_requests_being_served"):
        return {"worker": None, "serving": 0, "requests": [], "why": why}
    oldest, total = agent._requests_being_served(limit)
    requests = [{"id": request_id, "from": caller or None, "kind": kind, "age": round(age, 6),
                 "stage": stage,
                 # 0 from the table: no thread holds it (queued, waiting).
                 "thread": thread or None}
                for request_id, caller, kind, age, stage, thread in oldest]
    return {"worker": agent.get_worker_info().name, "serving": total,
            "requests": requests, "why": ""}


def answer(agent: Any, environ: dict, path: str) -> tuple[str, bytes]:
    """The status line and JSON body of the endpoint's ``/calls`` or
    ``/serving`` (``?limit=<how many>``)."""
    from urllib.parse import parse_qs

    query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    noun = "calls" if path == "/calls" else "requests"
    limit = CALLS_LIMIT
    if "limit" in query:
        text = query["limit"][-1]
        try:
            # ASCII digits only (int() would take " 5", "1_000", "٣").
            if not re.fullmatch(r"[0-9]{1,4}", text):
                raise ValueError
            limit = _check_limit(int(text))
        except ValueError:
            body = {"why": f"limit={text!r} is not a whole number of {noun}, 1 to "
                           f"{MAX_CALLS_LIMIT}"}
            return "400 Bad Request", json.dumps(body).encode()
    listed = calls_in_flight if path == "/calls" else requests_being_served
    return "200 OK", json.dumps(listed(agent, limit)).encode()
