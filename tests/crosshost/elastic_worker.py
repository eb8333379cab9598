# SPDX-License-Identifier: BSD-3-Clause
"""A member of the dynamic group of tests/crosshost/test_partition.py, run
inside a namespace host.

usage: python -m tests.crosshost.elastic_worker RANK INIT_METHOD ADDRESS

Joins the dynamic group kept in the store at INIT_METHOD (tcp://, on host
0: a partition cuts worker1 from the store too, as it would from a store on
another machine) as worker<RANK>, listening on ADDRESS with
heartbeat_timeout 2 s,
prints {"ready": true}, then answers one JSON command per stdin line with
one JSON line:

  {"op": "call", "to": NAME}   a call to NAME: "ok" or the error text
  {"op": "members"}            the members this worker sees
  {"op": "rejoin"}             rpc.shutdown(), then init_rpc again (a new
                               incarnation of the same name and rank)
"""

import json
import sys

import torch
from torch.distributed import rpc

import torch_rpc_ext


def join(rank, store, address):
    rpc.init_rpc(
        f"worker{rank}", rank=rank, backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
            init_method=store, address=address, rpc_timeout=30,
            heartbeat_timeout=2))


def main() -> None:
    rank, store, address = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    join(rank, store, address)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "call":
            try:
                rpc.rpc_sync(cmd["to"], torch.add, args=(torch.ones(1), 1))
                answer = {"call": "ok"}
            except RuntimeError as e:
                answer = {"call": str(e)}
        elif cmd["op"] == "members":
            answer = {"members": sorted(m.name for m in torch_rpc_ext.membership().members)}
        elif cmd["op"] == "rejoin":
            rpc.shutdown(graceful=False)
            join(rank, store, address)
            answer = {"rejoined": True}
        else:
            break
        print(json.dumps(answer), flush=True)
    rpc.shutdown(graceful=False)


if __name__ == "__main__":
    main()
