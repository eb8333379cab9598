# SPDX-License-Identifier: BSD-3-Clause
"""The RPC paper's gRPC baseline: tensors pickled into a bytes message.

A generic unary gRPC method (no protobuf codegen: the message is raw bytes)
whose request and response are pickle.dumps(tensor). Used by rpc_bench.py for
the tensor cases; rank 1 serves, rank 0 calls.
"""

import os
import pickle
import time
from concurrent import futures

import grpc
import torch
from _workloads import heavy, identity

METHOD = "/bench.Tensor/Call"
OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]


FUNCTIONS = {"identity": identity, "heavy": heavy}


def serve(port: int) -> None:
    """Serve until a call with the 'stop' function name arrives."""
    done = futures.Future()

    def call(request: bytes, context) -> bytes:
        name, x = pickle.loads(request)
        if name == "stop":
            done.set_result(None)
            return b""
        return pickle.dumps(FUNCTIONS[name](x))

    handler = grpc.method_handlers_generic_handler(
        "bench.Tensor", {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    done.result()
    server.stop(grace=1)


def world(rank, world_size, cases, repeats, repeats_large):
    """rank 1 serves; rank 0 times each (fn, MB, in-flight) case."""
    port = int(os.environ["MASTER_PORT"])
    if rank == 1:
        serve(port)
        return []
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=60)
    stub = channel.unary_unary(METHOD)
    rows = []
    for fname, mb, inflight in cases:
        side = int((mb * (1 << 20) / 4) ** 0.5)
        x = torch.ones(side, side)
        reps = repeats if mb <= 64 else repeats_large
        samples = []
        for _ in range(reps + 1):  # first call warms the channel
            t0 = time.perf_counter()
            calls = [stub.future(pickle.dumps((fname, x))) for _ in range(inflight)]
            for c in calls:
                pickle.loads(c.result())
            samples.append(time.perf_counter() - t0)
        rows.append((f"{fname}_{mb:g}MB_x{inflight}", samples[1:]))
    stub(pickle.dumps(("stop", None)))
    channel.close()
    return rows
