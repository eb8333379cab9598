# SPDX-License-Identifier: BSD-3-Clause
"""The CUDA driver layer (csrc/common/libcuda, csrc/channel/cuda) on this
machine: the loader without a driver, and device memory, export/import and
the copy engine against the fake driver (tests/cuda_fake), or the real one where the
machine has it (tools/gpu_check.sh).

What this proves is logic (descriptor tables, dimension merging, staging
reuse, launch parameters, the fd export/import sequence, lifetimes, error
texts), never hardware: the fake's device memory is host memory and its
kernels are memcpy by entry name. tools/gpu_check.sh runs the same worker
functions on a GPU.
"""

import ctypes.util
import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.cuda_driver import worker
from tests.cuda_driver.conftest import REAL_DRIVER, report, two_devices

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, env=full, cwd=ROOT,
    )


LOAD = """
    from torch_rpc_ext import _testing
    for _ in range(2):  # the same error on every call
        try:
            _testing.cuda.libcuda_description()
        except RuntimeError as e:
            print("ERROR", e)
"""


@pytest.mark.skipif(REAL_DRIVER, reason="this machine has a CUDA driver")
def test_no_driver_is_a_clear_error():
    out = run_python(LOAD, {"TORCH_RPC_EXT_LIBCUDA": ""})
    assert out.returncode == 0, out.stderr
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2 and errors[0] == errors[1]
    assert 'dlopen("libcuda.so.1")' in errors[0]
    assert "LD_LIBRARY_PATH" in out.stdout and "TORCH_RPC_EXT_LIBCUDA" in out.stdout


def test_a_named_library_that_is_missing_or_not_cuda():
    out = run_python(LOAD, {"TORCH_RPC_EXT_LIBCUDA": "/nonexistent/libcuda.so.1"})
    assert out.returncode == 0, out.stderr
    assert "/nonexistent/libcuda.so.1" in out.stdout
    assert "(named by TORCH_RPC_EXT_LIBCUDA)" in out.stdout
    libc = ctypes.util.find_library("c")
    out = run_python(LOAD, {"TORCH_RPC_EXT_LIBCUDA": libc})
    assert out.returncode == 0, out.stderr
    assert "cannot use the CUDA library" in out.stdout
    assert "it lacks cuInit, cuDriverGetVersion" in out.stdout, out.stdout


def test_cpu_rpc_loads_no_cuda_library():
    """A CPU-only group never loads the CUDA driver: not through our driver
    layer, nor through torch on our behalf (a CUDA torch maps its runtime,
    libcudart, at import, which does not count; the driver, libcuda, it
    loads on first use)."""
    code = """
        import os, torch
        import torch.distributed.rpc as rpc
        import torch_rpc_ext
        from torch_rpc_ext import _testing

        def driver():
            paths = {line.split()[-1] for line in open("/proc/self/maps")}
            return sorted(p for p in paths if os.path.basename(p).startswith("libcuda.so"))

        before = driver()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        rpc.init_rpc("solo", rank=0, world_size=1, backend=rpc.BackendType.TORCH_RPC_EXT)
        r = rpc.rpc_sync("solo", torch.add, args=(torch.ones(4), 1))
        rpc.shutdown()
        print(int(r.sum()), _testing.cuda.libcuda_load_attempted(), driver() == before, before)
    """
    out = run_python(code, {})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:3] == ["8", "False", "True"], out.stdout


def test_the_driver_loads(driver_env, driver):
    description, count, uuids = driver.describe()
    assert description.startswith("CUDA driver 1")
    if not REAL_DRIVER:
        assert driver_env["TORCH_RPC_EXT_LIBCUDA"] in description
        assert description.startswith("CUDA driver 13.0 (")
    assert count >= 1 and all(len(u) == 32 for u in uuids)
    assert len(set(uuids)) == count


def test_the_newest_ptx_isa_of_each_driver(driver):
    cu = worker.testing()
    assert [cu.max_ptx_isa(v) for v in (8000, 9000, 11040, 12000, 12040, 12060, 12080,
                                         13000, 13009)] == [0, 60, 74, 80, 84, 85, 87, 90, 90]
    assert cu.max_ptx_isa(13010) == -1  # newer than the table: left to the driver
    assert cu.ptx_isa("// .version 1.0\n.version 6.0\n.target sm_70\n") == 60
    assert cu.ptx_isa(".target sm_70\n") == -1


ENGINES = """
    import json
    from tests.cuda_driver import worker
    out = {}
    for compiled in (False, True):
        try:
            worker.testing().CopyEngine(0, worker.kernel_images(compiled))
            out[str(compiled)] = "loaded"
        except RuntimeError as e:
            out[str(compiled)] = str(e)
    print(json.dumps(out))
"""


@pytest.mark.skipif(REAL_DRIVER, reason="the fake's driver version")
def test_an_older_driver_loads_the_shipped_ptx_and_refuses_newer_naming_both(driver_env):
    """On a CUDA 12.4 driver (R550): the shipped kernels (ISA 6.0) load;
    NVVM 13's (ISA 9.0, what numba-cuda makes here) are refused before the
    driver is asked, with what to do. Before, the engine loaded NVVM's PTX
    and the driver refused it (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)."""
    pytest.importorskip("numba.cuda", reason="compiles the ISA 9.0 kernels")
    done = run_python(ENGINES, {**driver_env, "FAKE_CUDA_DRIVER_VERSION": "12040"})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["False"] == "loaded"
    assert "PTX is ISA 9.0, newer than this CUDA 12.4 driver loads (ISA 8.4 at most)" in out["True"]


@pytest.mark.parametrize(
    "sizes,strides,want",
    [
        ([4, 5], [5, 1], [(20, 1)]),  # contiguous: one dimension
        ([4, 5], [1, 4], [(4, 1), (5, 4)]),  # transposed: nothing merges
        ([2, 1, 3, 4], [12, 99, 4, 1], [(24, 1)]),  # size-1 dimensions drop
        ([3, 4, 5], [40, 5, 1], [(3, 40), (20, 1)]),  # a row-sliced block
        ([6, 7], [0, 1], [(6, 0), (7, 1)]),  # expanded
        ([3, 0, 2], [1, 1, 1], [(0, 1)]),  # empty
        ([], [], []),  # a scalar
        ([2, 3], [0, 0], [(6, 0)]),  # one element, broadcast
        ([3, 2], [2, 0], [(3, 2), (2, 0)]),  # inner broadcast
        ([3, 4], [1, 1], [(3, 1), (4, 1)]),  # overlapping
    ],
)
def test_merge_dims(driver, sizes, strides, want):
    assert driver.merge_dims(sizes, strides) == want


def test_copy_any_size_and_alignment(driver):
    cases = [(1, 0, 0), (15, 1, 3), (16, 0, 0), (17, 16, 16), (4097, 5, 5),
             ((1 << 20) + 3, 7, 2), (0, 0, 0)]
    assert driver.copies(cases) == [True] * len(cases)


def test_a_long_plain_copy_goes_to_the_drivers_copy(driver):
    # From 8 MiB on (CopyEngine::kDriverCopyMinBytes): the driver's copy
    # was 7% faster than copy_contiguous at 400 MB on an H200. Just under
    # it, the kernel; any alignment either way.
    # copy_kernel (the probe's) takes the kernel at any length.
    cases = [((8 << 20) - 1, 0, 0), (8 << 20, 0, 0), ((9 << 20) + 3, 5, 1),
             ((9 << 20) + 3, 5, 1, True)]
    ok, launches = driver.long_copies(cases)
    assert ok == [True] * len(cases)
    assert launches["copy_contiguous"] == 2 and launches["driver_copies"] == 2


def test_gather_and_scatter_many_tensors_in_one_launch(driver):
    sizes = [1024] * 1000 + [0, 1, 7, (256 << 10) + 5]
    ok, launches = driver.gather(sizes, 3)
    assert ok
    # Each round: one launch to gather, one to scatter.
    assert launches["copy_segments"] == 6 and launches["copy_contiguous"] == 0


def test_one_segment_is_a_plain_copy(driver):
    ok, launches = driver.gather([0, 5000, 0])
    assert ok and launches == {**launches, "copy_segments": 0, "copy_contiguous": 2}


def test_strided_views_pack_and_unpack(driver):
    cases = [
        ([513, 257], [1, 513], 4, 513 * 257),  # a transpose
        ([64, 33], [99, 3], 2, 64 * 99),  # every third column
        ([7, 5, 6], [1, 42, 7], 8, 5 * 6 * 7),  # a permutation
        ([32, 63], [1, 65], 1, 65 * 63),  # a sliced transpose of bytes
        ([11, 9], [1, 11], 16, 99),  # complex128
        ([4, 30, 40], [0, 40, 1], 4, 1200),  # expanded: pack only
        ([3, 4, 5], [40, 5, 1], 4, 120),  # merges into a 2-d view
        ([100], [1], 8, 100),  # contiguous: a plain copy
        ([40, 30], [1, 40], 4, 1200, 1),  # misaligned: moved as bytes
        ([10, 10], [1, 10], 16, 100, 8),  # 16-byte elements, 8-aligned
    ]
    ok, launches = driver.strided(cases)
    assert ok == [True] * len(cases)
    # Only the expanded view has rows of 512 bytes and more, and they
    # overlap (stride 0): the kernel moves it.
    assert launches["row_copies"] == 0
    if not REAL_DRIVER:  # the fake counts misaligned element accesses
        assert driver.fake_stats()["kernel_errors"] == 0


def test_views_of_whole_rows_move_by_one_pitched_copy(driver):
    # Rows contiguous inside, of 512 bytes or more: one cuMemcpy2DAsync
    # each way, no strided kernel (issue 46: the kernel moved one element
    # at a time, 2.6x torch's .contiguous() on an H200).
    cases = [
        ([32, 256], [512, 1], 4, 64 * 256),  # every other row of 64 x 256
        ([10, 600], [1000, 1], 1, 10 * 1000, 24),  # a column slice, offset
        ([4, 8, 128], [2048, 128, 1], 8, 4 * 2048),  # merges into rows
        ([3, 129], [300, 1], 4, 900),  # 516-byte rows, odd pitch
    ]
    ok, launches = driver.strided(cases)
    assert ok == [True] * len(cases)
    assert launches["row_copies"] == 2 * len(cases)  # a pack and an unpack each
    assert launches["pack_strided"] == launches["unpack_strided"] == 0


def test_threads_share_an_engine_and_its_staging(driver):
    ok, staging = driver.concurrent_gathers(2, 20)
    assert ok
    # 40 tables in flight at most; buffers are reused once their launch is
    # done, and never shared while in flight (the results say so).
    assert 1 <= staging <= 40


def test_missing_or_refused_kernels_are_named(driver):
    images = worker.kernel_images()
    del images["copy_segments"]
    assert "copy kernel 'copy_segments' missing" in driver.engine_error(images)
    images = worker.kernel_images()
    entry, ptx = images["pack_strided"]
    images["pack_strided"] = (entry, re.sub(r"\.version \S+", ".version 9.9", ptx))
    error = driver.engine_error(images)
    # Refused by the engine's own check, before the driver's, naming both.
    assert "pack_strided's PTX is ISA 9.9, newer than this CUDA 13.0 driver loads" in error
    assert "use the PTX torch_rpc_ext ships (ISA 6.0" in error
    images = worker.kernel_images()
    images["copy_contiguous"] = ("no_such_entry", images["copy_contiguous"][1])
    assert "cuModuleGetFunction: CUDA_ERROR_NOT_FOUND" in driver.engine_error(images)
    if not REAL_DRIVER:  # what a failed engine loaded, it unloaded
        assert driver.fake_stats()["live"]["modules"] == 0


def test_exported_memory_outlives_its_creator(spawn):
    pattern = bytes(range(256)) * 64
    a_conn, b_conn = spawn.Pipe()
    ctl_here, ctl_b = spawn.Pipe()
    owner = spawn.Process(target=worker.export_memory, args=(a_conn, 3 << 20, pattern))
    peer = spawn.Process(target=worker.import_memory, args=(b_conn, ctl_b, pattern))
    owner.start()
    peer.start()
    try:
        owner.join(120)
        assert owner.exitcode == 0
        ctl_here.send("the owner exited")
        size, granularity, seen, from_owner, after_exit, reexport = report(peer, ctl_here, "peer")
    finally:
        for p in (owner, peer):
            p.join(30)
            if p.is_alive():
                p.kill()
    assert size % granularity == 0 and size >= 3 << 20
    assert seen == pattern  # the peer sees what the owner wrote
    assert from_owner == pattern[::-1]  # and the owner what the peer wrote
    assert after_exit == pattern[::-1]  # still mapped after the owner exited
    assert "exported by its creator" in reexport
    assert peer.exitcode == 0


def _double(size):
    return 2 * size


def _same(size):
    return size


def test_legacy_memory_announced_larger_than_it_is_is_refused(spawn):
    """A legacy handle opens the whole allocation whatever size the peer
    announced with it, and copies out of a block are checked against the
    announced size: memory announced larger than it is would let a record
    name device memory past the mapping. The import checks the mapping's
    size and refuses, naming both; the true size opens."""
    a_conn, b_conn = spawn.Pipe()
    ctl_here, ctl_b = spawn.Pipe()
    owner = spawn.Process(target=worker.export_legacy, args=(a_conn, 2 << 20))
    peer = spawn.Process(target=worker.import_legacy, args=(b_conn, ctl_b, (_double, _same)))
    owner.start()
    peer.start()
    try:
        size, (larger, same) = report(peer, ctl_here, "importer")
    finally:
        for p in (owner, peer):
            p.join(30)
            if p.is_alive():
                p.kill()
    assert size == 2 << 20
    assert larger == (f"ValueError: imported CUDA memory of {size} bytes, "
                      f"announced as {2 * size}"), larger
    assert same == size


def test_a_block_whose_events_never_complete_holds_no_thread(driver):
    """A cuda_ipc block waits for its events before it is unmapped; a peer
    can record one on a stream that never finishes. The wait happens on the
    staging thread, polled, wherever the last reference goes (a loop thread,
    a thread freeing a received tensor): the drop returns at once, and the
    memory is freed once the stream gets through. Before, the drop waited
    (cuEventSynchronize) for as long as the stream was held."""
    hold_s = 3.0
    took, held, after = driver.block_teardown_waits_off_thread(hold_s)
    assert took < hold_s / 3, took
    if not REAL_DRIVER:
        assert held["vmm_handles"] >= 1, held  # kept while its event is pending
        assert after["vmm_handles"] == 0 and after["vmm_mappings"] == 0, after


@two_devices
def test_a_peer_that_never_completes_stalls_only_its_own_connections_releases(spawn):
    """A block read peer to peer (a map from the peer's cuda:0 to our cuda:1)
    records its events, after the reads, on a stream of cuda:0 that waits
    for them; those reads waited on the peer's `ready`, which a hostile peer
    never completes. Each connection has its own such stream: another
    peer's block is released at once. With one stream per device for the
    whole process, as before, the other block's release queues behind the
    held one and does not complete (asserted too, so the test shows what
    the own stream changes)."""
    with ProcessPoolExecutor(1, spawn) as pool:
        held, other = pool.submit(worker.peer_leases_release_apart, False, 10.0).result(60)
    assert (held, other) == (False, True)
    with ProcessPoolExecutor(1, spawn) as pool:
        held, other = pool.submit(worker.peer_leases_release_apart, True, 1.0).result(60)
    assert (held, other) == (False, False)
