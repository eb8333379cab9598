# SPDX-License-Identifier: BSD-3-Clause
"""A program that ends with its agent still running (no rpc.shutdown()).

Python finalises and libtorch's statics are destroyed while our threads may
still be decoding frames, serving requests or waiting for the GIL. The
process must still exit cleanly and promptly: no SIGSEGV, no std::terminate,
no hang (csrc/common/exit_gate.h). Real interpreters, not forks: forked
children leave through os._exit() and never finalise.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.rpc.world import free_port

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import os, sys, time, ctypes
    import torch
    from torch.distributed import rpc
    import torch_rpc_ext

    rank = int(sys.argv[1])
    how = sys.argv[2]

    def slow_echo(x):
        time.sleep(0.001)
        return x

    rpc.init_rpc(
        f"worker{rank}", rank=rank, world_size=2,
        backend=rpc.BackendType.TORCH_RPC_EXT,
        rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
            address="127.0.0.1", rpc_timeout=30, num_worker_threads=2),
    )
    other = f"worker{1 - rank}"
    rpc.rpc_sync(other, torch.add, args=(torch.ones(2), 1))

    import threading
    stop = threading.Event()

    def storm():
        # Calls to the peer until told to stop or a call fails (the peer is
        # gone). A Python thread still inside an RPC when finalisation
        # begins is ended by Python itself (a forced unwind through C++ that
        # aborts the process, with any backend), so this one is joined
        # before the end; the peer's storm goes on while this process exits:
        # its frames are being decoded, its requests served and its Python
        # UDFs are waiting for the GIL here.
        futs = []
        k = 0
        while not stop.is_set():
            try:
                futs.append(rpc.rpc_async(other, torch.add, args=(torch.ones(300_000), k)))
                futs.append(rpc.rpc_async(other, slow_echo, args=(torch.ones(1000),)))
            except Exception:
                return
            k += 1
            if len(futs) > 64:
                try:
                    futs.pop(0).wait()
                except Exception:
                    return

    thread = threading.Thread(target=storm)
    thread.start()
    if rank == 0:
        time.sleep(1.0)
        stop.set()
    # worker1 storms until its calls fail: worker0 is gone (however long a
    # busy host took to get it there), so worker0 always exits mid-storm.
    thread.join()
    print("leaving", flush=True)
    if how == "c-exit":
        ctypes.CDLL(None).exit(0)  # C exit(): no Python finalisation
    # how == "end": the script just ends.
    """
)


@pytest.mark.parametrize("how", ["end", "c-exit"])
def test_a_program_that_never_calls_shutdown_exits_cleanly(how, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), how],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            out, _ = p.communicate()
            out += "\n<hung: killed after 90 s>"
        outs.append((p.returncode, out))
    for rank, (code, out) in enumerate(outs):
        assert "leaving" in out, f"rank {rank} did not get going:\n{out[-3000:]}"
        assert code == 0, f"rank {rank} exited with {code}:\n{out[-3000:]}"
        assert "terminate called" not in out, out[-3000:]
