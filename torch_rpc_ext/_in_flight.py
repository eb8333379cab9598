# SPDX-License-Identifier: BSD-3-Clause
"""What a worker waits on: its calls in flight, oldest first
(``torch_rpc_ext.metrics.calls_in_flight`` and the metrics endpoint's
``/calls``; docs/observability.md, "Calls in flight").

A job that hangs is most often a worker waiting on a call that another
worker never answers; each worker's oldest calls say which peer, what kind
of call and for how long, as NCCL's flight recorder does for collectives.
"""

from __future__ import annotations

import json
import re
from typing import Any

CALLS_LIMIT = 20
MAX_CALLS_LIMIT = 1000


def _check_limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CALLS_LIMIT:
        raise ValueError(
            f"calls_in_flight(limit={limit!r}): a whole number of calls, 1 to {MAX_CALLS_LIMIT}")
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


def calls_answer(agent: Any, environ: dict) -> tuple[str, bytes]:
    """The status line and JSON body of the endpoint's ``/calls``
    (``?limit=<calls>``)."""
    from urllib.parse import parse_qs

    query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    limit = CALLS_LIMIT
    if "limit" in query:
        text = query["limit"][-1]
        try:
            # ASCII digits only (int() would take " 5", "1_000", "٣").
            if not re.fullmatch(r"[0-9]{1,4}", text):
                raise ValueError
            limit = _check_limit(int(text))
        except ValueError:
            body = {"why": f"limit={text!r} is not a whole number of calls, 1 to "
                           f"{MAX_CALLS_LIMIT}"}
            return "400 Bad Request", json.dumps(body).encode()
    return "200 OK", json.dumps(calls_in_flight(agent, limit)).encode()
