# SPDX-License-Identifier: BSD-3-Clause
"""Peak and settled RSS over a loop of large identity calls (issue #3 memory check).

Example: python benchmarks/memory_loop.py --mb 400 --calls 100
Prints one JSON line per backend: payload, baseline/peak/settled RSS of both
processes, and peak RSS as a multiple of the payload.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.distributed import rpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))
from _harness import emit, rss_mb, run_world  # noqa: E402


def identity(x):
    return x


def loop(rank, world_size, backend_key, mb, calls):
    import torch_rpc_ext

    opts = (
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=600)
        if backend_key == "TENSORPIPE"
        else torch_rpc_ext.RpcExtBackendOptions(rpc_timeout=600)
    )
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                 backend=rpc.BackendType[backend_key], rpc_backend_options=opts)
    out = {}
    if rank == 0:
        base = {"caller": rss_mb(), "callee": rpc.rpc_sync("w1", rss_mb)}
        x = torch.ones(mb * (1 << 20) // 4)
        t0 = time.perf_counter()
        peak_callee = 0.0
        for _ in range(calls):
            y = rpc.rpc_sync("w1", identity, args=(x,))
            del y
            peak_callee = max(peak_callee, rpc.rpc_sync("w1", rss_mb))
        elapsed = time.perf_counter() - t0
        del x
        time.sleep(3.5)  # idle long enough for cached buffers to be released
        settled = {"caller": rss_mb(), "callee": rpc.rpc_sync("w1", rss_mb)}
        out = {"base_mb": base, "settled_mb": settled, "callee_peak_mb": peak_callee,
               "seconds_per_call": round(elapsed / calls, 4)}
    rpc.shutdown()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--backends", nargs="+", default=["TORCH_RPC_EXT", "TENSORPIPE"])
    args = p.parse_args(argv)
    for key in args.backends:
        res, peak = run_world(loop, 2, key, args.mb, args.calls)
        payload = args.mb
        emit({
            "backend": key, "payload_mb": payload, "calls": args.calls, **res,
            "peak_rss_mb": peak,
            "peak_over_payload": {r: round((peak[r] - res["base_mb"]["caller" if r == 0 else "callee"]) / payload, 2)
                                  for r in peak},
        })


if __name__ == "__main__":
    main()
