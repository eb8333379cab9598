# SPDX-License-Identifier: BSD-3-Clause
"""What the first GPU run (shared/gpu-runs/2026-11-26-h200) found on the
receiving side, two workers each: a worker that never used CUDA gets a
CUDA tensor; a message that cannot land for want of device memory fails
its call, not the connection; device maps between the CPU and a GPU; and
TensorPipe's texts for CUDA tensors no map names. On the fake driver in CI
(whose allocator, like torch's, refuses until torch's CUDA init has run),
and on a GPU as they are (receive_worker.py)."""

import re

import pytest

from tests.cuda_driver import receive_worker
from tests.cuda_driver.conftest import REAL_DRIVER
from tests.cuda_driver.test_agent_cuda import gather, play_with
from tests.rpc.world import free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("slow_kernels")]


def test_a_worker_that_never_used_cuda_receives_cuda_tensors(spawn):
    """init_rpc with devices runs torch's CUDA init (torch.cuda.init(), as
    torch's registry does for TensorPipe) and the agent warms the device
    before any peer can send. Before, the first CUDA tensor closed the
    connection ("Allocator not initialized for device 0")."""
    caller, callee = play_with(spawn, receive_worker.run_untouched)
    assert "error" not in caller, caller
    assert caller["seen"]
    assert caller["callee_failures"] == 0
    if REAL_DRIVER:
        assert callee["initialized_before"] is False
        assert caller["callee_initialized"] is True
    else:
        modules, contexts = callee["warm"]
        assert modules == 4 and contexts >= 1  # the copy kernels, loaded at init


@pytest.mark.parametrize("channels,transports", [(("cuda_ipc",), None),
                                                 (("cuda_staged",), ("tcp",))],
                         ids=["cuda_ipc", "cuda_staged-tcp"])
@pytest.mark.parametrize("short", [1, 0], ids=["request", "response"])
def test_a_message_that_cannot_land_fails_its_call_and_keeps_the_connection(
        spawn, short, channels, transports):
    """32 MiB arrive at a worker that may hold 16 MiB of device memory: the
    landing's allocation fails. The call fails on both ends with the worker,
    the bytes and the cause; the connection is not closed as if the peer had
    broken the protocol (no rejected frame), and the next call on it works.
    Before, the connection closed and every call on it failed. Through
    cuda_staged (between hosts) the channel's staging block fails first on
    the fake: the segment's bytes are read and dropped, and the call fails
    the same way."""
    caller, _ = play_with(spawn, receive_worker.run_short, short, channels, transports)
    receiver, sender = ("worker1", "worker0") if short == 1 else ("worker0", "worker1")
    kind = "request" if short == 1 else "response"
    error = caller["error"]
    assert f"{receiver} could not receive the {kind} from {sender}" in error, error
    assert "33554432 bytes on cuda:0" in error, error
    assert re.search("out of memory|OUT_OF_MEMORY", error, re.I), error
    if "cuda_staged" in channels and not REAL_DRIVER:
        # The channel's own block, before torch's memory is asked.
        assert "cuda_staged could not land 33554432 bytes on cuda:0" in error, error
    assert caller["after"] is True
    if short == 1:
        # remote(), plain and wrapped for dist autograd.
        for remote in (caller["remote_error"], caller["autograd_remote_error"]):
            assert "worker1 could not receive the request from worker0" in remote, remote
            assert "ran for more than" not in remote  # not a timeout
    assert caller["failures"] == ((0, 3) if short == 1 else (1, 0))
    assert caller["rejected"] == {}


@pytest.mark.skipif(REAL_DRIVER, reason="the fake's switch that fails opening memory")
@pytest.mark.parametrize("sharing", ["fd", "legacy"])
def test_a_peer_that_cannot_map_our_blocks_fails_that_call_and_the_next_go_another_way(
        spawn, sharing):
    """worker1's driver will not map worker0's cuda_ipc block (out of
    memory or address space, say). The call that brought it fails, naming
    that; the connection stays, worker0 hears why and lends worker1 no
    block again, and the next calls go by cuda_ring, right. Before, the
    connection closed as if worker0 had broken the protocol, and every
    connection after failed the same way."""
    caller, _ = play_with(spawn, receive_worker.run_unmappable, sharing)
    error = caller["error"]
    assert "worker1 could not receive the request from worker0" in error, error
    assert "could not map the peer's CUDA block" in error, error
    assert re.search("out of memory|OUT_OF_MEMORY", error, re.I), error
    assert caller["after"] == [True, True] and caller["back"] is True
    ipc, ring = caller["counters"]["cuda_ipc"], caller["counters"]["cuda_ring"]
    assert caller["callee"]["blocks_refused"] == 1, caller["callee"]
    assert ipc["lending_refused"] == 1 and ipc["declined"] >= 2, ipc
    assert ring["segments_sent"] >= 2, ring  # the two calls after
    assert ipc["blocks_imported"] >= 1  # worker1's replies, by its blocks
    assert caller["failures"] == 1
    assert caller["rejected"] == {} and caller["lost"] == {}


@pytest.mark.skipif(REAL_DRIVER, reason="two devices on the fake, and its context counts")
@pytest.mark.parametrize("channels,transports", [(("cuda_staged",), ("tcp",)),
                                                 (("cuda_ring", "cuda_staged"), None),
                                                 (("cuda_ipc",), None)],
                         ids=["staged", "ring", "ipc"])
def test_a_tensor_for_a_device_we_do_not_serve_is_refused_before_it_lands(
        spawn, monkeypatch, channels, transports):
    """A peer that breaks init_rpc's agreement on device maps cannot make a
    worker hold a context (or staging memory) on a device it was not asked
    to use (cuda_staged and cuda_ring made one, and staging memory, on
    cuda:1 before the message failed). The message fails as one that cannot
    land does, naming the device; the connection stays."""
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    caller, _ = play_with(spawn, receive_worker.run_off_map, channels, transports)
    assert caller["callee_devices"] == ["cuda:0"]
    refused = ("worker1 could not receive the request from worker0: a tensor arrived "
               "for cuda:1, which is not among the devices of worker1 (the sender's "
               "device map names it)")
    assert refused in caller["error"], caller["error"]
    assert refused in caller["remote"], caller["remote"]
    if transports is None:  # shm: the remote() call's payload came in a slab
        assert caller["slab_segments"] >= 2, caller["slab_segments"]
    assert caller["callee_rejected"] == {}, caller["callee_rejected"]
    assert caller["callee_lost"] == 0
    assert caller["after"] == [2.0, 2.0]
    assert caller["callee_retains"][1] == 0, caller["callee_retains"]


def test_cpu_tensors_land_on_the_gpu_a_map_names_and_come_back_to_the_cpu(spawn):
    caller, _ = play_with(spawn, receive_worker.run_cpu_to_gpu)
    assert caller["devices"] == []  # a map from the CPU needs no GPU here
    assert caller["seen"]
    assert caller["back"] == ("cpu", True)
    assert caller["mixed"] == (["cpu", "cpu", "cpu"], True, 0, True)
    # Segments landed from host bytes (1 + 1 + 2: the two slices of `host`
    # share one); tensors sent back as host copies (1 + 3).
    assert caller["metrics"]["from_host_segments"] == 4
    assert caller["metrics"]["to_host_tensors"] == 4
    assert caller["metrics"]["receive_failures"] == 0


def test_cuda_tensors_land_on_the_cpu_a_map_names_and_come_back_to_the_gpu(spawn):
    caller, _ = play_with(spawn, receive_worker.run_gpu_to_cpu)
    assert caller["callee_devices"] == []  # worker1 uses no GPU at all
    assert caller["seen"]
    assert caller["back"] == ("cuda:0", True)
    assert caller["view"]  # a strided view: its elements, contiguous
    assert caller["neg"] and caller["conj"], caller  # resolved, as on the CPU
    assert caller["metrics"]["to_host_tensors"] == 5
    assert caller["metrics"]["from_host_segments"] == 1


def test_cuda_tensors_no_map_names_fail_with_tensorpipes_text(spawn):
    caller, _ = play_with(spawn, receive_worker.run_unmapped)
    # What upstream's test_device_maps_missing_config* match.
    request = ("TensorPipe RPC backend only supports CPU tensors by default.*"
               "`set_device_map` on `TensorPipeRpcBackendOptions`")
    for what in ("request", "remote_request"):
        assert re.search(request, caller[what]), caller[what]
    assert "Request device mapping is not available for destination worker1" in caller["request"]
    assert "no device map names cuda:0" in caller["request"]
    for what in ("response", "remote"):
        assert "Response device mapping is not available for destination worker0" in \
            caller[what], caller[what]
    assert caller["after"] == [2.0, 2.0]


def test_cuda_tensors_to_ones_own_worker_without_cuda_self_fail_naming_it(spawn):
    """A CUDA argument and a CUDA result between a worker and itself, with
    cuda_self left out of device_channels: each call fails at once, naming
    what would carry them."""
    port = free_port()
    ours, theirs = spawn.Pipe()
    proc = spawn.Process(target=receive_worker.run_self_without_cuda_self, args=(port, theirs))
    (out,) = gather([proc], [(ours, theirs)])
    # Before session 58: "carries memory of device type 1", and nothing more.
    assert "carries CUDA memory" in out["error"], out["error"]
    assert "device_channels" in out["error"] and "cuda_self" in out["error"], out["error"]
    assert out["pending"] == 0  # and rpc.shutdown() does not wait for it
    # The same for a CUDA result: the call fails with it, not a timeout.
    assert "carries CUDA memory" in out["response_error"], out["response_error"]
    assert out["after"] == [2.0, 2.0]


def test_a_worker_exits_without_a_cuda_error(spawned, monkeypatch, capfd):
    """cuda_staged's staging thread trims its pools every second; at exit it
    used to run on after the driver had shut down and print "cuda_staged
    could not free idle memory: ... CUDA error 4" (the H200 run). It stops
    at the exit gate (Python's atexit, before the driver's exit handler),
    and a shut-down driver is not an error then. The fake holds its exit
    handler 2.5 s, so a trim would meet it."""
    from tests.cuda_driver import agent_worker

    monkeypatch.setenv("FAKE_CUDA_EXIT_DELAY_MS", "2500")
    caller, _ = play_with(spawned, agent_worker.run, ("cuda_staged",))
    assert caller["counters"]["cuda_staged"]["segments_sent"] > 0
    err = capfd.readouterr().err
    assert "could not free idle memory" not in err, err
    assert "DEINITIALIZED" not in err and "shutting down" not in err, err
