# SPDX-License-Identifier: BSD-3-Clause
"""A connection the kernel refuses to watch (epoll_ctl(EPOLL_CTL_ADD) failing:
ENOMEM, or fs.epoll.max_user_watches reached) fails its calls at once, in
words naming that, and the next call dials again. Until session 97 the
refusal escaped into the loop's log: the connection stayed connecting with no
timer, and every call to that peer waited out its timeout.

The refusal is real: the worker runs under an LD_PRELOAD shim whose
epoll_ctl fails ADD with ENOSPC in the process (and while) a file names."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch.distributed import rpc

from tests.rpc.world import init, run_world

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <unistd.h>

typedef int (*epoll_ctl_fn)(int, int, int, struct epoll_event*);

int epoll_ctl(int epfd, int op, int fd, struct epoll_event* event) {
  static epoll_ctl_fn real;
  if (!real) {
    real = (epoll_ctl_fn)dlsym(RTLD_NEXT, "epoll_ctl");
  }
  const char* path = getenv("EPOLL_SHIM_FAIL_PID_FILE");
  if (op == EPOLL_CTL_ADD && path) {
    FILE* f = fopen(path, "r");
    if (f) {
      long pid = 0;
      int n = fscanf(f, "%ld", &pid);
      fclose(f);
      if (n == 1 && pid == (long)getpid()) {
        errno = ENOSPC;
        return -1;
      }
    }
  }
  return real(epfd, op, fd, event);
}
"""


_DONE = threading.Event()


def done():
    _DONE.set()


def dials(name):
    metrics = rpc.api._get_current_rpc_agent().get_metrics()
    return int(metrics[f"rpc_ext.peer.{name}.dials"])


def refused_watch(rank, world_size):
    init(rank, world_size, rpc_timeout=20)
    out = {}
    if rank == 0:
        out["dials_before"] = dials("worker1")
        path = os.environ["EPOLL_SHIM_FAIL_PID_FILE"]
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        try:
            out["first"] = rpc.rpc_sync("worker1", max, args=(1, 2))
        except RuntimeError as e:
            out["first"] = str(e)
        os.unlink(path)
        out["second"] = rpc.rpc_sync("worker1", max, args=(3, 4))
        out["dials_after"] = dials("worker1")
        rpc.rpc_sync("worker1", done)
    else:
        # Not before: worker0 refuses to watch any connection meanwhile,
        # this one's to it too (the shutdown's gather).
        _DONE.wait(60)
    rpc.shutdown()
    return out


def main():
    print(json.dumps(run_world(refused_watch, timeout=90)[0]))


def test_a_connection_the_loop_cannot_watch_fails_its_call_at_once(tmp_path):
    shim = tmp_path / "epoll_shim.so"
    source = tmp_path / "epoll_shim.c"
    source.write_text(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(shim), str(source), "-ldl"], check=True)
    env = dict(os.environ)
    env["LD_PRELOAD"] = str(shim)
    env["EPOLL_SHIM_FAIL_PID_FILE"] = str(tmp_path / "fail_pid")
    run = subprocess.run(
        [sys.executable, "-c", "from tests.rpc.test_loop_registration import main; main()"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # The first call dialled worker1 (no connection of ours to it before).
    assert out["dials_before"] == 0, out
    assert isinstance(out["first"], str), out
    assert "the event loop could not watch the connection" in out["first"], out
    assert "No space left on device" in out["first"], out
    # The next call dialled again and was answered.
    assert out["second"] == 4 and out["dials_after"] == 2, out
