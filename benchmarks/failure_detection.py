# SPDX-License-Identifier: BSD-3-Clause
"""How long a pending call to a failed peer takes to fail.

One caller and N victims on this host. For each victim the caller leaves a
30 s call pending on it, then kills it with SIGKILL (or freezes it with
SIGSTOP: its sockets stay open, only the heartbeat can tell), and measures
the time from the signal to the call's failure. rpc_timeout is 60 s.

  python benchmarks/failure_detection.py --victims 8 --signal KILL
  python benchmarks/failure_detection.py --victims 4 --signal STOP --heartbeat 2

Prints one JSON line: per-victim times, median, max, and the first error.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import run_world  # noqa: E402


def _pid():
    return os.getpid()


def detect(rank, world_size, sig, heartbeat):
    import torch_rpc_ext

    rpc.init_rpc(
        f"w{rank}", rank=rank, world_size=world_size,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
            address="127.0.0.1", rpc_timeout=60, heartbeat_timeout=heartbeat),
    )
    if rank != 0:
        time.sleep(3600)  # until the caller's signal
        return None
    times, first_error = [], None
    for victim in range(1, world_size):
        name = f"w{victim}"
        pid = rpc.rpc_sync(name, _pid)
        fut = rpc.rpc_async(name, time.sleep, args=(30,))
        time.sleep(0.2)
        t0 = time.monotonic()
        os.kill(pid, getattr(signal, f"SIG{sig}"))
        try:
            fut.wait()
            times.append(None)
        except RuntimeError as e:
            times.append(round(time.monotonic() - t0, 3))
            first_error = first_error or str(e)
        if sig != "KILL":
            os.kill(pid, signal.SIGKILL)
    rpc.shutdown(graceful=False)
    got = [t for t in times if t is not None]
    return {"signal": sig, "heartbeat_timeout": heartbeat, "victims": world_size - 1,
            "seconds": times, "median": statistics.median(got) if got else None,
            "max": max(got) if got else None, "first_error": first_error}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--victims", type=int, default=8)
    p.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    p.add_argument("--heartbeat", type=float, default=10.0)
    args = p.parse_args(argv)
    r, _ = run_world(detect, args.victims + 1, args.signal, args.heartbeat,
                     timeout=600, dies=args.victims)
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
