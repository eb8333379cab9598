# SPDX-License-Identifier: BSD-3-Clause
"""A worker of tests/crosshost/test_partition.py, run inside a namespace host.

usage: python -m tests.crosshost.partition_worker RANK MASTER PORT ADDRESS OPTIONS

Both workers join a static group of two (rendezvous tcp://MASTER:PORT, the
agent on ADDRESS, OPTIONS a JSON object of RpcExtBackendOptions keywords).
Worker 1 serves until its stdin closes. Worker 0 takes one JSON command per
line on stdin and answers each with one JSON line on stdout:

  {"op": "start", "n": N, "sleep": S}   start N calls to worker1, each of
                                        which records its id there and
                                        sleeps S seconds; answers at once
                                        ("bytes": B: each call carries a
                                        tensor of B bytes there and back,
                                        "ok" only if it returns intact)
  {"op": "wait"}                        wait for the started calls; answers
                                        {"results": [...], "elapsed": s},
                                        each result "ok" or the error text
  {"op": "executed"}                    the ids worker1 has executed
  {"op": "hold"}                        an RRef owned by worker1, and a
                                        distributed autograd context whose
                                        forward pass went through worker1
  {"op": "use"}                         the RRef's value and the context's
                                        backward pass, each a value or the
                                        error text
  {"op": "lanes"}                       the tcp_lanes counters of both ends
  {"op": "quit"}                        shut down and exit
"""

import json
import sys
import time

import torch
import torch.distributed.autograd as dist_autograd
from torch.distributed import rpc

import torch_rpc_ext

_executed: list[int] = []


def record_and_sleep(call_id: int, seconds: float, payload=None):
    """Runs on worker1: remembers that call `call_id` ran (at most once is
    what the test checks), then takes `seconds`; returns `payload` too, if
    it came with one."""
    _executed.append(call_id)
    time.sleep(seconds)
    return call_id if payload is None else (call_id, payload)


def lanes() -> dict:
    m = rpc.api._get_current_rpc_agent().get_metrics()
    prefix = "rpc_ext.channel.tcp_lanes."
    return {k[len(prefix):]: int(v) for k, v in m.items() if k.startswith(prefix)}


def executed() -> list[int]:
    return list(_executed)


def main() -> None:
    rank, master, port, me = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    extra = json.loads(sys.argv[5])
    rpc.init_rpc(
        f"worker{rank}", rank=rank, world_size=2,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
            init_method=f"tcp://{master}:{port}", address=me, **extra),
    )
    print(json.dumps({"ready": True}), flush=True)
    if rank == 1:
        sys.stdin.read()  # serve until the test closes our stdin
        rpc.shutdown(graceful=False)
        return
    futures, payloads, next_id = [], [], 0
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "start":
            for _ in range(cmd["n"]):
                args = (next_id, cmd["sleep"])
                payload = None
                if cmd.get("bytes"):
                    payload = torch.full((cmd["bytes"] // 4,), float(next_id))
                    args += (payload,)
                futures.append(rpc.rpc_async("worker1", record_and_sleep, args=args))
                payloads.append(payload)
                next_id += 1
            answer = {"started": len(futures)}
        elif cmd["op"] == "wait":
            t0, results = time.monotonic(), []
            for f, payload in zip(futures, payloads):
                try:
                    got = f.wait()
                    intact = payload is None or torch.equal(got[1], payload)
                    results.append("ok" if intact else "payload damaged")
                except RuntimeError as e:
                    results.append(str(e))
            answer = {"results": results, "elapsed": time.monotonic() - t0}
            futures, payloads = [], []
        elif cmd["op"] == "executed":
            answer = {"executed": rpc.rpc_sync("worker1", executed)}
        elif cmd["op"] == "lanes":
            answer = {"ours": lanes(), "theirs": rpc.rpc_sync("worker1", lanes)}
        elif cmd["op"] == "hold":
            rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
            rref.to_here()
            context = dist_autograd.context()
            context_id = context.__enter__()
            x = torch.tensor([3.0], requires_grad=True)
            y = rpc.rpc_sync("worker1", torch.mul, args=(x, x))
            answer = {"held": True}
        elif cmd["op"] == "use":
            answer = {}
            try:
                answer["rref"] = rref.to_here().tolist()
            except RuntimeError as e:
                answer["rref"] = str(e)
            try:
                dist_autograd.backward(context_id, [y.sum()])
                answer["grad"] = dist_autograd.get_gradients(context_id)[x].tolist()
            except RuntimeError as e:
                answer["grad"] = str(e)
            context.__exit__(None, None, None)
        else:
            break
        print(json.dumps(answer), flush=True)
    rpc.shutdown(graceful=False)


if __name__ == "__main__":
    main()
