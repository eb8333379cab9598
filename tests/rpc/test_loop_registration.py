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
import torch
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
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

typedef int (*epoll_ctl_fn)(int, int, int, struct epoll_event*);

/* EPOLL_SHIM_FAIL_KIND: "listener" fails only listening sockets, "wakeup"
   only unnamed Unix socket pairs (our wake-up signals), else every ADD. */
static int chosen(int fd) {
  const char* kind = getenv("EPOLL_SHIM_FAIL_KIND");
  int listening = 0;
  socklen_t len = sizeof(listening);
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0) {
    listening = 0;
  }
  if (kind && strcmp(kind, "listener") == 0) {
    return listening;
  }
  if (kind && strcmp(kind, "wakeup") == 0) {
    struct sockaddr_storage peer;
    socklen_t plen = sizeof(peer);
    if (listening || getpeername(fd, (struct sockaddr*)&peer, &plen) != 0) {
      return 0;
    }
    return peer.ss_family == AF_UNIX && plen <= sizeof(sa_family_t);
  }
  return 1;
}

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
      if (n == 1 && pid == (long)getpid() && chosen(fd)) {
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


def refuse(kind):
    """From now on, epoll_ctl ADD fails in this process for `kind` (the
    shim's modes) until the returned file is removed."""
    os.environ["EPOLL_SHIM_FAIL_KIND"] = kind
    path = os.environ["EPOLL_SHIM_FAIL_PID_FILE"]
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    return path


def first_and_second(fn, *args):
    """worker0's first call to worker1 while refused (its answer or error),
    and the next once no longer refused."""
    path = os.environ["EPOLL_SHIM_FAIL_PID_FILE"]
    try:
        first = rpc.rpc_sync("worker1", fn, args=args)
    except RuntimeError as e:
        first = str(e)
    os.unlink(path)
    return first, rpc.rpc_sync("worker1", fn, args=args)


def finish(rank):
    if rank == 0:
        rpc.rpc_sync("worker1", done)
    else:
        # Not before: worker0 may refuse to watch any connection meanwhile,
        # this one's to it too (the shutdown's gather).
        _DONE.wait(60)
    rpc.shutdown()


def dials(name):
    metrics = rpc.api._get_current_rpc_agent().get_metrics()
    return int(metrics[f"rpc_ext.peer.{name}.dials"])


def refused_watch(rank, world_size):
    init(rank, world_size, rpc_timeout=20)
    out = {}
    if rank == 0:
        out["dials_before"] = dials("worker1")
        refuse("all")
        out["first"], out["second"] = first_and_second(max, 3, 4)
        out["dials_after"] = dials("worker1")
    finish(rank)
    return out


def refused_listener(rank, world_size):
    if rank == 1:
        # Its listener is refused from the start, for a second.
        threading.Timer(1.0, os.unlink, args=(refuse("listener"),)).start()
    init(rank, world_size, rpc_timeout=20)
    out = {}
    if rank == 0:
        out["answer"] = rpc.rpc_sync("worker1", max, args=(1, 2))
    finish(rank)
    return out


def refused_wakeup(rank, world_size):
    # A frame ring each way (its signal socket is watched) and the shm_ring
    # channel (its wake-up socket too).
    init(rank, world_size, rpc_timeout=20, shm_frame_ring_bytes=1 << 20, channels=["shm_ring"])
    out = {}
    if rank == 0:
        refuse("wakeup")
        out["first"], out["second"] = first_and_second(sum_of, torch.ones(1 << 20))
    finish(rank)
    return out


def sum_of(t):
    return float(t.sum())


WORLDS = {"watch": refused_watch, "listener": refused_listener, "wakeup": refused_wakeup}


def main(world):
    print(json.dumps(run_world(WORLDS[world], timeout=90)[0]))


def run_under_shim(tmp_path, world):
    shim = tmp_path / "epoll_shim.so"
    source = tmp_path / "epoll_shim.c"
    source.write_text(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(shim), str(source), "-ldl"], check=True)
    env = dict(os.environ)
    env["LD_PRELOAD"] = str(shim)
    env["EPOLL_SHIM_FAIL_PID_FILE"] = str(tmp_path / "fail_pid")
    run = subprocess.run(
        [sys.executable, "-c", f"from tests.rpc.test_loop_registration import main; main({world!r})"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_listener_the_loop_cannot_watch_is_watched_again(tmp_path):
    """worker1's listener is refused for its first second: it is watched again
    once the kernel takes it (until session 97, never: no dial to worker1
    completed its handshake)."""
    assert run_under_shim(tmp_path, "listener")["answer"] == 2


def test_a_wakeup_the_loop_cannot_watch_closes_its_connection(tmp_path):
    """worker0's frame ring and channel wake-ups are refused while it makes
    its first call: that connection closes naming that (or, were its answer
    in first, the call is answered), and the next call dials again."""
    out = run_under_shim(tmp_path, "wakeup")
    first = out["first"]
    assert first == float(1 << 20) or "could not watch a wake-up" in first, out
    assert out["second"] == float(1 << 20), out


def test_a_connection_the_loop_cannot_watch_fails_its_call_at_once(tmp_path):
    out = run_under_shim(tmp_path, "watch")
    # The first call dialled worker1 (no connection of ours to it before).
    assert out["dials_before"] == 0, out
    assert isinstance(out["first"], str), out
    assert "the event loop could not watch the connection" in out["first"], out
    assert "No space left on device" in out["first"], out
    # The next call dialled again and was answered.
    assert out["second"] == 4 and out["dials_after"] == 2, out
