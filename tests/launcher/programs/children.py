# SPDX-License-Identifier: BSD-3-Clause
"""Starts two plain Python children (subprocess, this interpreter) and
prints one JSON line with what each saw of init_rpc: the first as the
launcher leaves it, the second with a broken torch_rpc_ext first on its
path (PLANTED, a folder the test makes), so it cannot load ours.

    python -m torch_rpc_ext.run children.py PLANTED
"""

import json
import os
import subprocess
import sys

CHILD = """
import json, torch.distributed.rpc as rpc
seen = {"switched": getattr(rpc.init_rpc, "_torch_rpc_ext_launcher", False)}
try:
    rpc.init_rpc("child", rank=0, world_size=1)
    seen["init"] = type(rpc.api._get_current_rpc_agent()).__name__
    rpc.shutdown()
except RuntimeError as e:
    seen["error"] = str(e)
print(json.dumps(seen))
"""


def child(env: dict) -> dict:
    """Run CHILD in a fresh interpreter with ``env``; its JSON line."""
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=120)
    sys.stderr.write(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    good = child(env)
    planted = dict(env, PYTHONPATH=os.pathsep.join([sys.argv[1], env["PYTHONPATH"]]))
    broken = child(planted)
    print(json.dumps({"good": good, "broken": broken}))
