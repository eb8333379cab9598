# SPDX-License-Identifier: BSD-3-Clause
"""One worker of tests/rpc/test_partition.py, run inside a network namespace.

usage: partition_worker.py RANK MASTER_IP PORT MY_IP
Rank 0 prints READY once a slow call to worker1 is pending, waits for CUT on
stdin (the test has cut the link), then prints how the call ended as JSON.
"""

import json
import sys
import time

import torch
from torch.distributed import rpc

import torch_rpc_ext


def main() -> None:
    rank, master, port, me = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    rpc.init_rpc(
        f"worker{rank}", rank=rank, world_size=2,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
            init_method=f"tcp://{master}:{port}", address=me,
            rpc_timeout=60, heartbeat_timeout=2),
    )
    if rank == 1:
        time.sleep(120)  # serve until the test kills us
        return
    ok = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)).item() == 2.0
    fut = rpc.rpc_async("worker1", time.sleep, args=(30,))
    print("READY", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    try:
        fut.wait()
        err = None
    except RuntimeError as e:
        err = str(e)
    print(json.dumps({"before_cut_ok": ok, "detect_s": time.monotonic() - t0, "error": err}),
          flush=True)
    rpc.shutdown(graceful=False)


if __name__ == "__main__":
    main()
