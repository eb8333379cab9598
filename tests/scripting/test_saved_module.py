# SPDX-License-Identifier: BSD-3-Clause
"""A scripted module that calls remote functions, saved with torch.jit.save
and loaded in a fresh process that has neither its source nor the callee's:
only torch and torch_rpc_ext. Three processes: the one that scripts and
saves (its source file deleted afterwards), the callee, and the loader."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.rpc.world import free_port

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]

MODEL_SOURCE = """
import sys
import torch

class ShardCaller(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.torch_rpc_ext.rpc_sync("worker1", "shard.scale", (x, 10))
        assert isinstance(y, torch.Tensor)
        fut = torch.ops.torch_rpc_ext.rpc_async("worker1", "shard.offset", (y, 1.0))
        z = fut.wait()
        assert isinstance(z, torch.Tensor)
        return z * self.weight

import torch_rpc_ext  # the ops must exist to script the module
torch.jit.save(torch.jit.script(ShardCaller()), sys.argv[1])
"""

CALLEE_SOURCE = """
import os
import torch
from torch.distributed import rpc
import torch_rpc_ext
from torch_rpc_ext import scripting

def scale(x, k):
    return x * k

@torch.jit.script
def offset(y: torch.Tensor, b: float) -> torch.Tensor:
    return y + b

scripting.register("shard.scale", scale)  # served from the first request on
scripting.register("shard.offset", offset)
rpc.init_rpc("worker1", rank=1, world_size=2, backend=rpc.BackendType.TORCH_RPC_EXT,
             rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(address="127.0.0.1"))
rpc.rpc_sync("worker0", torch.add, args=(torch.ones(1), 1))  # worker0 is done calling
rpc.shutdown()
"""

LOADER_SOURCE = """
import json, os, sys
import torch
from torch.distributed import rpc
import torch_rpc_ext

rpc.init_rpc("worker0", rank=0, world_size=2, backend=rpc.BackendType.TORCH_RPC_EXT,
             rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(address="127.0.0.1"))
model = torch.jit.load(sys.argv[1])
x = torch.arange(4.0)
out = model(x)
modules = sorted(m for m in sys.modules if m.split(".")[0] in ("shard_model", "callee"))
rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
rpc.shutdown()
print(json.dumps({"out": out.tolist(), "modules": modules}))
"""


def python(script: Path, *args: str, cwd: Path, port: int = 0) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_saved_scripted_module_runs_where_no_python_source_is(tmp_path):
    for folder in ("owner", "callee", "loader"):
        (tmp_path / folder).mkdir()
    model_py = tmp_path / "owner" / "shard_model.py"
    model_py.write_text(textwrap.dedent(MODEL_SOURCE))
    saved = tmp_path / "shard_model.pt"
    save = python(model_py, str(saved), cwd=tmp_path / "owner")
    _, err = save.communicate(timeout=120)
    assert save.returncode == 0, err
    model_py.unlink()  # the module's source is gone before anyone loads it

    callee_py = tmp_path / "callee" / "callee.py"
    callee_py.write_text(textwrap.dedent(CALLEE_SOURCE))
    loader_py = tmp_path / "loader" / "load_and_call.py"
    loader_py.write_text(textwrap.dedent(LOADER_SOURCE))
    port = free_port()
    callee = python(callee_py, cwd=tmp_path / "callee", port=port)
    loader = python(loader_py, str(saved), cwd=tmp_path / "loader", port=port)
    try:
        out, err = loader.communicate(timeout=120)
        assert loader.returncode == 0, err
        _, callee_err = callee.communicate(timeout=60)
        assert callee.returncode == 0, callee_err
    finally:
        for p in (callee, loader):
            if p.poll() is None:
                p.kill()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["out"] == [(x * 10 + 1.0) * 2.0 for x in range(4)]
    assert result["modules"] == []
