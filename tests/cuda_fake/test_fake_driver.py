# SPDX-License-Identifier: BSD-3-Clause
"""The fake CUDA driver (fake_libcuda.cpp) itself, driven with ctypes.

The CUDA channel tests trust the fake, so these check that it exports what
csrc/common/libcuda.h loads under cuda.h's ABI names, enforces the rules the
channel must follow on a GPU (cuInit first, a current context per thread,
PROT_NONE VMM memory until cuMemSetAccess, no opening one's own IPC handles,
no driver calls from host functions, PTX no newer than the driver) and runs
work as a GPU would: streams in order and after the call returned, events as
counters across processes, the four copy kernels as real PTX launches whose
results must equal numpy's. Anything cross-process runs in spawned children.
Synchronisation is by gates and events, never by sleeping.
"""

import ctypes
import faulthandler
import json
import mmap
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import traceback
from contextlib import contextmanager
from ctypes import byref, c_char, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p
from itertools import count
from multiprocessing import reduction
from pathlib import Path

import numpy as np
import pytest

from tests import cuda_fake
from torch_rpc_ext import _preloaded as preloaded

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
GRANULARITY = 2 * MiB

# CUresult values (test_error_names checks them against the fake's names).
SUCCESS = 0
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
NOT_INITIALIZED = 3
NO_DEVICE = 100
INVALID_DEVICE = 101
INVALID_IMAGE = 200
INVALID_CONTEXT = 201
INVALID_PTX = 218
UNSUPPORTED_PTX_VERSION = 222
INVALID_HANDLE = 400
NOT_FOUND = 500
NOT_READY = 600
LAUNCH_FAILED = 719
CONTEXT_IS_DESTROYED = 709
NOT_PERMITTED = 800
NOT_SUPPORTED = 801
STREAM_CAPTURE_UNSUPPORTED = 900

GLOBAL, RELAXED = 0, 2  # CUstreamCaptureMode

POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
EVENT_IPC = 0x2 | 0x4  # CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS
LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class Location(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", c_int),
        ("requestedHandleTypes", c_int),
        ("location", Location),
        ("win32HandleMetaData", c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", c_int)]


class Handle(ctypes.Structure):  # CUipcMemHandle, CUipcEventHandle
    _fields_ = [("reserved", c_char * 64)]


class Memcpy2D(ctypes.Structure):  # CUDA_MEMCPY2D
    _fields_ = [
        ("srcXInBytes", c_size_t), ("srcY", c_size_t), ("srcMemoryType", c_int),
        ("srcHost", c_void_p), ("srcDevice", c_uint64), ("srcArray", c_void_p),
        ("srcPitch", c_size_t),
        ("dstXInBytes", c_size_t), ("dstY", c_size_t), ("dstMemoryType", c_int),
        ("dstHost", c_void_p), ("dstDevice", c_uint64), ("dstArray", c_void_p),
        ("dstPitch", c_size_t),
        ("WidthInBytes", c_size_t), ("Height", c_size_t),
    ]


class Uuid(ctypes.Structure):
    _fields_ = [("bytes", c_char * 16)]


P = ctypes.POINTER
HOSTFN = ctypes.CFUNCTYPE(None, c_void_p)
u64 = c_uint64
# Every entry point of libcuda.h by its ABI name, with cuda.h's parameters.
SIGNATURES = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [P(c_int)],
    "cuGetErrorName": [c_int, P(c_char_p)],
    "cuGetErrorString": [c_int, P(c_char_p)],
    "cuDeviceGetCount": [P(c_int)],
    "cuDeviceGet": [P(c_int), c_int],
    "cuDeviceGetUuid_v2": [P(Uuid), c_int],
    "cuDeviceGetAttribute": [P(c_int), c_int, c_int],
    "cuDeviceCanAccessPeer": [P(c_int), c_int, c_int],
    "cuDevicePrimaryCtxRetain": [P(c_void_p), c_int],
    "cuDevicePrimaryCtxRelease_v2": [c_int],
    "cuCtxGetCurrent": [P(c_void_p)],
    "cuCtxSetCurrent": [c_void_p],
    "cuMemAlloc_v2": [P(u64), c_size_t],
    "cuMemFree_v2": [u64],
    "cuMemGetAddressRange_v2": [P(u64), P(c_size_t), u64],
    "cuMemcpyHtoD_v2": [u64, c_void_p, c_size_t],
    "cuMemcpyDtoH_v2": [c_void_p, u64, c_size_t],
    "cuMemcpyAsync": [u64, u64, c_size_t, c_void_p],
    "cuMemcpy2DAsync_v2": [P(Memcpy2D), c_void_p],
    "cuMemcpyHtoDAsync_v2": [u64, c_void_p, c_size_t, c_void_p],
    "cuMemcpyDtoHAsync_v2": [c_void_p, u64, c_size_t, c_void_p],
    "cuMemHostAlloc": [P(c_void_p), c_size_t, c_uint],
    "cuMemFreeHost": [c_void_p],
    "cuMemHostRegister_v2": [c_void_p, c_size_t, c_uint],
    "cuMemHostUnregister": [c_void_p],
    "cuMemGetAllocationGranularity": [P(c_size_t), P(Prop), c_int],
    "cuMemCreate": [P(u64), c_size_t, P(Prop), u64],
    "cuMemRelease": [u64],
    "cuMemExportToShareableHandle": [c_void_p, u64, c_int, u64],
    "cuMemImportFromShareableHandle": [P(u64), c_void_p, c_int],
    "cuMemAddressReserve": [P(u64), c_size_t, c_size_t, u64, u64],
    "cuMemAddressFree": [u64, c_size_t],
    "cuMemMap": [u64, c_size_t, c_size_t, u64, u64],
    "cuMemUnmap": [u64, c_size_t],
    "cuMemSetAccess": [u64, c_size_t, P(AccessDesc), c_size_t],
    "cuIpcGetMemHandle": [P(Handle), u64],
    "cuIpcOpenMemHandle_v2": [P(u64), Handle, c_uint],
    "cuIpcCloseMemHandle": [u64],
    "cuStreamCreate": [P(c_void_p), c_uint],
    "cuStreamDestroy_v2": [c_void_p],
    "cuStreamSynchronize": [c_void_p],
    "cuStreamWaitEvent": [c_void_p, c_void_p, c_uint],
    "cuThreadExchangeStreamCaptureMode": [P(c_int)],
    "cuLaunchHostFunc": [c_void_p, HOSTFN, c_void_p],
    "cuEventCreate": [P(c_void_p), c_uint],
    "cuEventDestroy_v2": [c_void_p],
    "cuEventRecord": [c_void_p, c_void_p],
    "cuEventQuery": [c_void_p],
    "cuEventSynchronize": [c_void_p],
    "cuIpcGetEventHandle": [P(Handle), c_void_p],
    "cuIpcOpenEventHandle": [P(c_void_p), Handle],
    "cuModuleLoadData": [P(c_void_p), c_char_p],
    "cuModuleUnload": [c_void_p],
    "cuModuleGetFunction": [P(c_void_p), c_void_p, c_char_p],
    "cuLaunchKernel": [c_void_p, *[c_uint] * 7, c_void_p, P(c_void_p), P(c_void_p)],
}


class Cuda:
    """The fake through ctypes: ``cu("cuName", *args)`` raises on an error,
    ``cu.rc(...)`` returns the CUresult."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(str(path))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = argtypes, c_int
        self.lib.fake_cuda_stats.argtypes = [c_char_p, c_size_t]
        self.lib.fake_cuda_stats.restype = c_int
        self._callbacks = []  # host functions must outlive their stream work

    def rc(self, name, *args) -> int:
        return getattr(self.lib, name)(*args)

    def __call__(self, name, *args) -> None:
        rc = self.rc(name, *args)
        if rc != SUCCESS:
            raise AssertionError(f"{self.error_name(rc)}: {self.stats()['last_error']}")

    def error_name(self, rc) -> str:
        text = c_char_p()
        self.lib.cuGetErrorName(rc, byref(text))
        return text.value.decode() if text.value else f"CUresult {rc}"

    def stats(self) -> dict:
        n = self.lib.fake_cuda_stats(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self.lib.fake_cuda_stats(buf, n + 1)
        return json.loads(buf.value)

    def setup(self, device=0) -> "Cuda":
        """cuInit, then the device's primary context current on this thread."""
        self("cuInit", 0)
        self.ctx = c_void_p()
        self("cuDevicePrimaryCtxRetain", byref(self.ctx), device)
        self("cuCtxSetCurrent", self.ctx)
        return self

    def uuid(self, device) -> bytes:
        out = Uuid()
        self("cuDeviceGetUuid_v2", byref(out), device)
        return bytes(out)

    def attribute(self, attrib, device=0) -> int:
        value = c_int()
        self("cuDeviceGetAttribute", byref(value), attrib, device)
        return value.value

    def alloc(self, nbytes) -> int:
        ptr = u64()
        self("cuMemAlloc_v2", byref(ptr), nbytes)
        return ptr.value

    def htod(self, ptr, data) -> None:
        src = np.frombuffer(bytes(data), np.uint8)
        self("cuMemcpyHtoD_v2", ptr, src.ctypes.data, src.size)

    def dtoh(self, ptr, nbytes) -> bytes:
        out = np.zeros(nbytes, np.uint8)
        self("cuMemcpyDtoH_v2", out.ctypes.data, ptr, nbytes)
        return out.tobytes()

    def upload(self, data) -> int:
        """A new allocation holding data (at least one byte)."""
        data = bytes(data)
        ptr = self.alloc(max(len(data), 1))
        self.htod(ptr, data)
        return ptr

    def stream(self) -> c_void_p:
        s = c_void_p()
        self("cuStreamCreate", byref(s), 0)
        return s

    def event(self, flags=0) -> c_void_p:
        ev = c_void_p()
        self("cuEventCreate", byref(ev), flags)
        return ev

    def host_func(self, stream, fn) -> None:
        callback = HOSTFN(lambda _: fn())
        self._callbacks.append(callback)
        self("cuLaunchHostFunc", stream, callback, None)

    def vmm_create(self, size, handle_types=POSIX_FD) -> int:
        handle = u64()
        self("cuMemCreate", byref(handle), size, byref(prop(handle_types)), 0)
        return handle.value

    def vmm_map(self, handle, size, access=True) -> int:
        """Reserve, map and (unless told not to) make read-write."""
        ptr = u64()
        self("cuMemAddressReserve", byref(ptr), size, 0, 0, 0)
        self("cuMemMap", ptr.value, size, 0, handle, 0)
        if access:
            desc = AccessDesc(Location(1, 0), READWRITE)
            self("cuMemSetAccess", ptr.value, size, byref(desc), 1)
        return ptr.value

    def vmm_unmap(self, ptr, size) -> None:
        self("cuMemUnmap", ptr, size)
        self("cuMemAddressFree", ptr, size)

    def launch(self, fn, *params, grid=(2, 1, 1), block=(64, 1, 1), stream=None):
        """cuLaunchKernel's CUresult, params as uint64 values."""
        values = [u64(p) for p in params]
        args = (c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        return self.rc("cuLaunchKernel", fn, *grid, *block, 0, stream, args, None)


def prop(handle_types=POSIX_FD, device=0) -> Prop:
    p = Prop()
    p.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    p.requestedHandleTypes = handle_types
    p.location = Location(1, device)  # CU_MEM_LOCATION_TYPE_DEVICE
    return p


@pytest.fixture(scope="module")
def lib_path():
    return cuda_fake.build()


@pytest.fixture(scope="module")
def cu(lib_path):
    """The fake in this process, initialised, context current on this thread."""
    return Cuda(lib_path).setup()


_copies = count()


@pytest.fixture
def fresh(lib_path, tmp_path, monkeypatch):
    """A fresh, uninitialised instance: a copy of the library (dlopen loads a
    file once), with the FAKE_CUDA_* variables given, read at its cuInit."""

    def load(**env) -> Cuda:
        for name in (
            "FAKE_CUDA_DEVICES",
            "FAKE_CUDA_NO_VMM",
            "FAKE_CUDA_NO_IPC_EVENTS",
            "FAKE_CUDA_UUID_SALT",
            "FAKE_CUDA_IPC_SELF",
            "FAKE_CUDA_MEM_LIMIT",
            "FAKE_CUDA_DRIVER_VERSION",
        ):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        copy = tmp_path / f"fake_libcuda-{next(_copies)}.so"
        shutil.copy(lib_path, copy)
        return Cuda(copy)

    return load


# ----------------------------------------------------- spawned children

# Spawn's semantics, from a fork server that imported torch once.
_SPAWN = preloaded.start_context()


def _child_main(task, path, conn):
    try:
        task(Cuda(path).setup(), conn)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


@contextmanager
def child(task, lib_path):
    """Runs task(cu, conn) in a spawned process; yields (process, conn)."""
    ours, theirs = _SPAWN.Pipe()
    proc = _SPAWN.Process(target=_child_main, args=(task, str(lib_path), theirs))
    proc.start()
    theirs.close()
    try:
        yield proc, ours
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()


def recv(conn, timeout=60):
    assert conn.poll(timeout), "the child sent nothing"
    message = conn.recv()
    if isinstance(message, tuple) and message and message[0] == "error":
        pytest.fail(f"the child failed:\n{message[1]}")
    return message


# ------------------------------------------------------------------ tests


def test_exports_exactly_the_abi_names_of_libcuda_h(lib_path):
    header = ROOT / "csrc" / "common" / "libcuda.h"
    if not header.is_file():
        pytest.skip("csrc/common/libcuda.h is not in this checkout")
    names = re.findall(r"^\s*X\((\w+)\)", header.read_text(), re.M)
    assert len(names) > 40
    # The ABI name of each is what cuda.h's macros make of it.
    source = "#include <cuda.h>\n" + "".join(f"FAKE_ABI {n}\n" for n in names)
    preprocessed = subprocess.run(
        ["g++", "-E", "-P", f"-I{cuda_fake._cuda_include_dir()}", "-x", "c++", "-"],
        input=source,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    abi = re.findall(r"^FAKE_ABI (\w+)$", preprocessed, re.M)
    assert len(abi) == len(names) and "cuMemAlloc_v2" in abi
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm is not installed")
    listing = subprocess.run(
        [nm, "-D", "--defined-only", str(lib_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exported = {line.split()[-1] for line in listing.splitlines()}
    assert exported == {*abi, "fake_cuda_stats", "fake_cuda_reset_stats",
                        "fake_cuda_set_global_capture", "fake_cuda_fail_dtoh_after",
                        "fake_cuda_set_kernel_delay_ms", "fake_cuda_set_alloc_delay_ms"}
    assert set(SIGNATURES) == set(abi)  # what the tests below call


def test_has_no_thread_local_storage(lib_path):
    """The fake is dlopen'ed (in the stream fuzzer too), and LeakSanitizer's
    scan of a dlopen'ed module's dynamic TLS crashes its tracer now and then
    ("Tracer caught signal 11", clang 14), which fails CI's fuzz round: its
    per-thread state lives in pthread keys. A `thread_local` in it gives the
    library a PT_TLS program header, read here from the ELF header."""
    data = lib_path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1  # 64-bit LE
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    types = [struct.unpack_from("<I", data, phoff + i * phentsize)[0]
             for i in range(phnum)]
    assert 1 in types  # PT_LOAD: the headers were read right
    assert 7 not in types, "fake_libcuda has a TLS segment (a thread_local)"


def test_every_call_before_cuinit_is_not_initialized(fresh):
    cu = fresh()
    before_init = set(SIGNATURES) - {
        "cuInit",
        "cuDriverGetVersion",
        "cuGetErrorName",
        "cuGetErrorString",
    }
    for name in sorted(before_init):
        args = [argtype() for argtype in SIGNATURES[name]]  # zeros and NULLs
        assert cu.rc(name, *args) == NOT_INITIALIZED, name
    version = c_int()
    cu("cuDriverGetVersion", byref(version))
    assert version.value == 13000
    assert cu.error_name(NOT_INITIALIZED) == "CUDA_ERROR_NOT_INITIALIZED"
    assert cu.rc("cuInit", 1) == INVALID_VALUE
    cu("cuInit", 0)
    cu("cuInit", 0)  # again: no-op
    n = c_int()
    cu("cuDeviceGetCount", byref(n))
    assert n.value == 1


def _fork_child(cu, conn):
    n = c_int()
    pid = os.fork()
    if pid == 0:  # CUDA does not survive fork(): every call fails
        conn.send((cu.rc("cuDeviceGetCount", byref(n)), cu.rc("cuInit", 0)))
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    cu("cuDeviceGetCount", byref(n))  # the parent is unaffected


def test_cuda_after_fork_is_not_initialized(lib_path):
    with child(_fork_child, lib_path) as (proc, conn):
        assert recv(conn) == (NOT_INITIALIZED, NOT_INITIALIZED)
    assert proc.exitcode == 0


def test_devices_uuids_and_attributes(fresh):
    cu = fresh(FAKE_CUDA_DEVICES="3").setup()
    n, dev = c_int(), c_int()
    cu("cuDeviceGetCount", byref(n))
    assert n.value == 3
    cu("cuDeviceGet", byref(dev), 2)
    assert dev.value == 2
    assert cu.rc("cuDeviceGet", byref(dev), 3) == INVALID_DEVICE
    uuids = [cu.uuid(d) for d in range(3)]
    assert len(set(uuids)) == 3 and all(len(u) == 16 for u in uuids)
    assert [fresh(FAKE_CUDA_DEVICES="3").setup().uuid(d) for d in range(3)] == uuids
    other = fresh(FAKE_CUDA_DEVICES="3", FAKE_CUDA_UUID_SALT="another-host").setup()
    assert not {other.uuid(d) for d in range(3)} & set(uuids)
    # multiprocessors, compute capability, VMM, POSIX fd handles
    assert [cu.attribute(a) for a in (16, 75, 76, 102, 103)] == [4, 9, 0, 1, 1]
    value = c_int()
    assert cu.rc("cuDeviceGetAttribute", byref(value), 2, 0) == INVALID_VALUE
    assert cu.rc("cuDeviceGetAttribute", byref(value), 16, 3) == INVALID_DEVICE
    none = fresh(FAKE_CUDA_DEVICES="0")
    assert none.rc("cuInit", 0) == NO_DEVICE
    assert none.rc("cuDeviceGetCount", byref(n)) == NOT_INITIALIZED


def test_without_vmm_cumemcreate_is_not_supported(fresh):
    cu = fresh(FAKE_CUDA_NO_VMM="1").setup()
    assert cu.attribute(102) == 0 and cu.attribute(103) == 0
    handle = u64()
    rc = cu.rc("cuMemCreate", byref(handle), GRANULARITY, byref(prop()), 0)
    assert rc == NOT_SUPPORTED
    cu("cuMemFree_v2", cu.alloc(100))  # legacy allocations still work


def test_error_names_cover_every_code_the_fake_returns(cu):
    names = {}
    for code in range(1000):
        text = c_char_p()
        if cu.lib.cuGetErrorName(code, byref(text)) == SUCCESS:
            names[text.value.decode()] = code
            assert cu.rc("cuGetErrorString", code, byref(text)) == SUCCESS
            assert text.value
    used = set(
        re.findall(r"\bCUDA_(?:SUCCESS|ERROR_\w+)", cuda_fake.SOURCE.read_text())
    )
    assert used <= names.keys()
    for name, value in globals().items():
        if isinstance(value, int) and f"CUDA_ERROR_{name}" in names:
            assert names[f"CUDA_ERROR_{name}"] == value, name
    text = c_char_p(b"x")
    assert cu.rc("cuGetErrorName", 12345, byref(text)) == INVALID_VALUE
    assert text.value is None


def test_a_new_thread_has_no_current_context(cu):
    results = {}

    def run():
        ctx, ptr, handle = c_void_p(), u64(), u64()
        results["current"] = cu.rc("cuCtxGetCurrent", byref(ctx)), ctx.value
        results["codes"] = [
            cu.rc("cuMemAlloc_v2", byref(ptr), 256),
            cu.rc("cuMemHostAlloc", byref(ctx), 256, 0),
            cu.rc("cuMemCreate", byref(handle), GRANULARITY, byref(prop()), 0),
            cu.rc("cuMemAddressReserve", byref(ptr), GRANULARITY, 0, 0, 0),
            cu.rc("cuStreamCreate", byref(ctx), 0),
            cu.rc("cuEventCreate", byref(ctx), 0),
            cu.rc("cuModuleLoadData", byref(ctx), b".version 9.0"),
            cu.rc("cuMemcpyHtoD_v2", 0, None, 0),
            cu.rc("cuStreamSynchronize", None),  # the NULL stream is per context
        ]
        cu("cuCtxSetCurrent", cu.ctx)
        cu("cuMemFree_v2", cu.alloc(256))
        results["done"] = True

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert results["current"] == (SUCCESS, None)
    assert results["codes"] == [INVALID_CONTEXT] * 9
    assert results["done"]


def test_a_released_primary_context_is_destroyed(fresh):
    cu = fresh().setup()
    cu("cuDevicePrimaryCtxRelease_v2", 0)
    ptr = u64()
    assert cu.rc("cuMemAlloc_v2", byref(ptr), 64) == CONTEXT_IS_DESTROYED
    assert cu.rc("cuDevicePrimaryCtxRelease_v2", 0) == INVALID_CONTEXT
    again = c_void_p()
    cu("cuDevicePrimaryCtxRetain", byref(again), 0)
    assert again.value == cu.ctx.value
    cu("cuMemFree_v2", cu.alloc(64))


def test_device_memory_ranges_and_copies(cu):
    live = cu.stats()["live"]["allocations"]
    data = np.random.default_rng(0).bytes(1000)
    base = cu.upload(data)
    assert base % 256 == 0 and cu.dtoh(base, 1000) == data
    found, size = u64(), c_size_t()
    cu("cuMemGetAddressRange_v2", byref(found), byref(size), base + 999)
    assert (found.value, size.value) == (base, 1000)
    for outside in (base + 1000, np.zeros(8).ctypes.data):
        assert cu.rc("cuMemGetAddressRange_v2", None, None, outside) == NOT_FOUND
    host = np.zeros(200, np.uint8)
    # Copies must stay inside device memory on their device side.
    assert cu.rc("cuMemcpyHtoD_v2", base + 900, host.ctypes.data, 200) == INVALID_VALUE
    assert cu.rc("cuMemcpyDtoH_v2", host.ctypes.data, base + 900, 200) == INVALID_VALUE
    assert (
        cu.rc("cuMemcpyHtoD_v2", host.ctypes.data, host.ctypes.data, 8) == INVALID_VALUE
    )
    assert cu.stats()["live"]["allocations"] == live + 1
    assert cu.rc("cuMemFree_v2", base + 8) == INVALID_VALUE
    cu("cuMemFree_v2", base)
    assert cu.rc("cuMemFree_v2", base) == INVALID_VALUE
    assert cu.stats()["live"]["allocations"] == live


def test_a_pitched_copy_moves_rows_and_is_counted(cu):
    # Every other row of 8 rows of 16 bytes, device to device, packed into
    # 4 rows: what a strided view whose rows are contiguous travels by.
    DEVICE_MEM = 2
    src = cu.upload(bytes(range(128)))
    dst = cu.alloc(64)
    before = cu.stats()["calls"].get("cuMemcpy2DAsync_v2", 0)
    c = Memcpy2D(srcMemoryType=DEVICE_MEM, srcDevice=src, srcPitch=32,
                 dstMemoryType=DEVICE_MEM, dstDevice=dst, dstPitch=16,
                 WidthInBytes=16, Height=4)
    s = cu.stream()
    cu("cuMemcpy2DAsync_v2", byref(c), s)
    cu("cuStreamSynchronize", s)
    assert cu.dtoh(dst, 64) == b"".join(bytes(range(r, r + 16)) for r in range(0, 128, 32))
    assert cu.stats()["calls"]["cuMemcpy2DAsync_v2"] == before + 1
    # A pitch narrower than the width, and rows past the allocation.
    c.srcPitch = 8
    assert cu.rc("cuMemcpy2DAsync_v2", byref(c), s) == INVALID_VALUE
    c.srcPitch, c.Height = 32, 5
    assert cu.rc("cuMemcpy2DAsync_v2", byref(c), s) == INVALID_VALUE
    cu("cuMemFree_v2", src)
    cu("cuMemFree_v2", dst)


def test_pinned_host_memory(cu):
    ptr = c_void_p()
    assert cu.rc("cuMemHostAlloc", byref(ptr), 64, 8) == INVALID_VALUE
    cu("cuMemHostAlloc", byref(ptr), 4096, 0x2)
    ctypes.memmove(ptr.value, b"pinned", 6)
    dev = cu.alloc(64)
    cu("cuMemcpyAsync", dev, ptr.value, 6, None)  # host <-> device by address
    assert cu.dtoh(dev, 6) == b"pinned"
    cu("cuMemFreeHost", ptr)
    assert cu.rc("cuMemFreeHost", ptr) == INVALID_VALUE
    assert cu.rc("cuMemFreeHost", np.zeros(8).ctypes.data) == INVALID_VALUE
    cu("cuMemFree_v2", dev)


def test_registered_host_memory_is_pinned_and_pageable_copies_are_counted(cu):
    # An asynchronous copy whose host side is neither cuMemHostAlloc's nor
    # registered runs, but is counted (a GPU would run it synchronously,
    # through a bounce buffer); registered memory counts as pinned until it
    # is unregistered. Overlapping or unknown ranges are refused as cuda.h
    # says.
    already, unknown = 712, 713
    page = mmap.mmap(-1, 8192)
    host = ctypes.addressof(ctypes.c_char.from_buffer(page))
    dev, s = cu.alloc(64), cu.stream()
    before = cu.stats()["pageable_copies"]
    cu("cuMemcpyHtoDAsync_v2", dev, host, 64, s)
    assert cu.stats()["pageable_copies"] == before + 1
    cu("cuMemHostRegister_v2", host, 8192, 1)
    assert cu.stats()["live"]["host_registered"] == 1
    assert cu.rc("cuMemHostRegister_v2", host + 4096, 4096, 1) == already
    assert cu.rc("cuMemHostRegister_v2", host, 64, 0x80) == INVALID_VALUE
    cu("cuMemcpyHtoDAsync_v2", dev, host + 4096, 64, s)
    cu("cuMemcpyDtoHAsync_v2", host, dev, 64, s)
    assert cu.stats()["pageable_copies"] == before + 1
    assert cu.rc("cuMemHostUnregister", host + 4096) == unknown
    cu("cuMemHostUnregister", host)
    assert cu.stats()["live"]["host_registered"] == 0
    cu("cuMemcpyDtoHAsync_v2", host, dev, 64, s)
    assert cu.stats()["pageable_copies"] == before + 2
    cu("cuStreamSynchronize", s)
    cu("cuStreamDestroy_v2", s)
    cu("cuMemFree_v2", dev)
    del host
    page.close()


def test_a_stream_runs_its_work_in_order_after_the_calls_returned(cu):
    gate, seen = threading.Event(), []
    s = cu.stream()
    cu.host_func(s, lambda: seen.append(("gate", gate.wait(60))))
    dev = cu.alloc(64)
    src, out = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    cu("cuMemcpyHtoDAsync_v2", dev, src.ctypes.data, 64, s)
    cu("cuMemcpyDtoHAsync_v2", out.ctypes.data, dev, 64, s)
    cu.host_func(s, lambda: seen.append(("copied", out.copy())))
    ev = cu.event()
    cu("cuEventRecord", ev, s)
    assert cu.rc("cuEventQuery", ev) == NOT_READY and seen == []
    gate.set()
    cu("cuStreamSynchronize", s)
    assert seen[0] == ("gate", True)
    assert seen[1][0] == "copied" and (seen[1][1] == src).all()
    assert cu.rc("cuEventQuery", ev) == SUCCESS
    cu("cuEventDestroy_v2", ev)
    cu("cuStreamDestroy_v2", s)
    cu("cuMemFree_v2", dev)


def test_the_null_stream_is_a_stream(cu):
    seen = []
    for handle in (None, 1, 2):  # 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
        cu.host_func(handle, lambda h=handle: seen.append(h))
        cu("cuStreamSynchronize", handle)
    assert seen == [None, 1, 2]
    assert cu.rc("cuStreamDestroy_v2", None) == INVALID_HANDLE


def test_host_functions_may_not_call_the_driver(cu):
    codes = []
    ptr = u64()
    cu.host_func(None, lambda: codes.append(cu.rc("cuMemAlloc_v2", byref(ptr), 64)))
    cu("cuStreamSynchronize", None)
    assert codes == [NOT_PERMITTED]


def test_stream_destroy_returns_at_once_and_the_work_still_runs(cu):
    live = cu.stats()["live"]["streams"]
    gate = threading.Event()
    s, ev = cu.stream(), cu.event()
    cu.host_func(s, lambda: gate.wait(60))
    cu("cuEventRecord", ev, s)
    cu("cuStreamDestroy_v2", s)  # the gate is still closed
    assert cu.stats()["live"]["streams"] == live
    assert cu.rc("cuEventQuery", ev) == NOT_READY
    assert cu.rc("cuStreamSynchronize", s) == INVALID_HANDLE
    gate.set()
    cu("cuEventSynchronize", ev)
    cu("cuEventDestroy_v2", ev)


def test_a_faulted_copy_out_is_reported_by_the_next_event_on_its_stream(cu):
    # fake_cuda_fail_dtoh_after(1): the second copy out of the device from
    # now writes nothing and the next event recorded after it on its stream
    # reports CUDA_ERROR_LAUNCH_FAILED, once; other streams' events do not.
    dev, s, other = cu.alloc(64), cu.stream(), cu.stream()
    src = np.arange(64, dtype=np.uint8)
    first, second = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    cu("cuMemcpyHtoD_v2", dev, src.ctypes.data, 64)
    ev, elsewhere = cu.event(), cu.event()
    cu.lib.fake_cuda_fail_dtoh_after(ctypes.c_long(1))
    try:
        cu("cuMemcpyDtoHAsync_v2", first.ctypes.data, dev, 64, s)
        cu("cuMemcpyDtoHAsync_v2", second.ctypes.data, dev, 64, s)
        cu("cuEventRecord", ev, s)
        cu("cuEventRecord", elsewhere, other)
        cu("cuStreamSynchronize", s)
        cu("cuStreamSynchronize", other)
        assert (first == src).all() and not second.any()
        assert cu.rc("cuEventQuery", elsewhere) == SUCCESS
        assert cu.rc("cuEventQuery", ev) == LAUNCH_FAILED
        assert cu.rc("cuEventQuery", ev) == SUCCESS  # reported once
        cu("cuMemcpyDtoHAsync_v2", second.ctypes.data, dev, 64, s)  # one fault only
        cu("cuStreamSynchronize", s)
        assert (second == src).all()
    finally:
        cu.lib.fake_cuda_fail_dtoh_after(ctypes.c_long(-1))
    for e in (ev, elsewhere):
        cu("cuEventDestroy_v2", e)
    for stream in (s, other):
        cu("cuStreamDestroy_v2", stream)
    cu("cuMemFree_v2", dev)


def test_events_are_counters(cu):
    gate = threading.Event()
    s1, s2, s3 = cu.stream(), cu.stream(), cu.stream()
    ev, late, after = cu.event(), cu.event(), cu.event()
    assert cu.rc("cuEventQuery", ev) == SUCCESS  # never recorded: complete
    cu("cuEventSynchronize", ev)
    cu.host_func(s1, lambda: gate.wait(60))
    # A wait takes the record that is the latest when it is made: none yet.
    cu("cuStreamWaitEvent", s3, late, 0)
    cu("cuEventRecord", late, s1)
    cu("cuStreamSynchronize", s3)  # returns with the gate closed
    cu("cuEventRecord", ev, s1)
    cu("cuStreamWaitEvent", s2, ev, 0)
    cu("cuEventRecord", after, s2)
    assert cu.rc("cuEventQuery", ev) == NOT_READY
    assert cu.rc("cuEventQuery", after) == NOT_READY  # s2 waits for s1
    gate.set()
    cu("cuEventSynchronize", after)
    assert cu.rc("cuEventQuery", ev) == SUCCESS
    assert cu.rc("cuStreamWaitEvent", s2, ev, 1) == INVALID_VALUE
    for stream in (s1, s2, s3):
        cu("cuStreamDestroy_v2", stream)
    for event in (ev, late, after):
        cu("cuEventDestroy_v2", event)
    assert cu.rc("cuEventDestroy_v2", ev) == INVALID_HANDLE


def test_a_wait_is_for_the_record_it_saw_not_a_later_one(cu):
    # An event re-recorded on a faster stream (a pooled event taken again)
    # completes its later record first; a wait made before it still waits
    # for the earlier one, as on a GPU. The fake once counted only the
    # highest record done, and let the wait through.
    gate, reached = threading.Event(), threading.Event()
    held, free, waiting = cu.stream(), cu.stream(), cu.stream()
    ev, after = cu.event(), cu.event()
    cu.host_func(held, lambda: gate.wait(60))
    cu("cuEventRecord", ev, held)
    cu("cuStreamWaitEvent", waiting, ev, 0)
    cu.host_func(waiting, reached.set)
    cu("cuEventRecord", after, waiting)
    cu("cuEventRecord", ev, free)
    cu("cuStreamSynchronize", free)
    assert cu.rc("cuEventQuery", ev) == SUCCESS  # its latest record is done
    assert not reached.wait(0.5)  # the wait is for the first
    assert cu.rc("cuEventQuery", after) == NOT_READY
    gate.set()
    cu("cuEventSynchronize", after)
    assert reached.is_set()
    for stream in (held, free, waiting):
        cu("cuStreamDestroy_v2", stream)
    for event in (ev, after):
        cu("cuEventDestroy_v2", event)


def test_without_interprocess_events_an_ipc_event_is_not_supported(fresh):
    cu = fresh(FAKE_CUDA_NO_IPC_EVENTS="1").setup()
    ipc_event_supported = 125  # CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED
    assert cu.attribute(ipc_event_supported) == 0
    event = c_void_p()
    assert cu.rc("cuEventCreate", byref(event), EVENT_IPC) == NOT_SUPPORTED
    cu("cuEventDestroy_v2", cu.event(0x2))  # other events still work
    assert fresh().setup().attribute(ipc_event_supported) == 1


def test_interprocess_event_rules_in_one_process(cu):
    handle, event = Handle(), c_void_p()
    assert cu.rc("cuEventCreate", byref(event), 0x4) == INVALID_VALUE  # no 0x2
    assert cu.rc("cuEventCreate", byref(event), 0x8) == INVALID_VALUE
    plain, ipc = cu.event(0x2), cu.event(EVENT_IPC)
    assert cu.rc("cuIpcGetEventHandle", byref(handle), plain) == INVALID_VALUE
    cu("cuIpcGetEventHandle", byref(handle), ipc)
    assert cu.rc("cuIpcOpenEventHandle", byref(event), handle) == INVALID_CONTEXT
    cu("cuEventDestroy_v2", plain)
    cu("cuEventDestroy_v2", ipc)


def test_ipc_handles_open_in_their_own_process_only_when_asked(fresh):
    # FAKE_CUDA_IPC_SELF=1: for the fuzz harness, which plays both ends of
    # cuda_ipc in one process.
    cu = fresh(FAKE_CUDA_IPC_SELF="1").setup()
    data = b"self" * 100
    base = cu.upload(data)
    mem, ev_handle = Handle(), Handle()
    cu("cuIpcGetMemHandle", byref(mem), base)
    ptr = u64()
    cu("cuIpcOpenMemHandle_v2", byref(ptr), mem, LAZY_PEER_ACCESS)
    assert cu.dtoh(ptr.value, len(data)) == data
    cu("cuIpcCloseMemHandle", ptr.value)
    ipc, opened = cu.event(EVENT_IPC), c_void_p()
    cu("cuIpcGetEventHandle", byref(ev_handle), ipc)
    cu("cuIpcOpenEventHandle", byref(opened), ev_handle)
    # Any other value keeps the real drivers' rule.
    strict = fresh(FAKE_CUDA_IPC_SELF="0").setup()
    base = strict.upload(data)
    strict("cuIpcGetMemHandle", byref(mem), base)
    assert strict.rc("cuIpcOpenMemHandle_v2", byref(ptr), mem, LAZY_PEER_ACCESS) == INVALID_CONTEXT


def _legacy_ipc_child(cu, conn):
    handle, gone, size = conn.recv()
    handle = Handle.from_buffer_copy(handle)
    ptr, again = u64(), u64()
    flags_zero = cu.rc("cuIpcOpenMemHandle_v2", byref(ptr), handle, 0)
    cu("cuIpcOpenMemHandle_v2", byref(ptr), handle, LAZY_PEER_ACCESS)
    cu("cuIpcOpenMemHandle_v2", byref(again), handle, LAZY_PEER_ACCESS)
    found = u64()
    cu("cuMemGetAddressRange_v2", byref(found), None, ptr.value + 5)
    data = cu.dtoh(ptr.value, size)
    cu.htod(ptr.value, b"reply")
    cu("cuIpcCloseMemHandle", ptr.value)
    cu("cuIpcCloseMemHandle", again.value)
    conn.send(
        {
            "flags_zero": flags_zero,
            "same_address": again.value == ptr.value == found.value,
            "data": data,
            "third_close": cu.rc("cuIpcCloseMemHandle", ptr.value),
            "freed": cu.rc(
                "cuIpcOpenMemHandle_v2",
                byref(ptr),
                Handle.from_buffer_copy(gone),
                LAZY_PEER_ACCESS,
            ),
            "uuid": cu.uuid(0),
            "opens": cu.stats()["ipc_mem_opens"],
        }
    )


def test_legacy_ipc_across_processes(cu, lib_path):
    size = 10_000
    data = np.random.default_rng(1).bytes(size)
    base = cu.upload(data)
    handle, interior, gone = Handle(), Handle(), Handle()
    cu("cuIpcGetMemHandle", byref(handle), base)
    cu("cuIpcGetMemHandle", byref(interior), base + 1234)
    assert bytes(interior) == bytes(handle)  # names the whole allocation
    ptr = u64()
    rc = cu.rc("cuIpcOpenMemHandle_v2", byref(ptr), handle, LAZY_PEER_ACCESS)
    assert rc == INVALID_CONTEXT  # a process cannot open its own handles
    host = np.zeros(8)
    assert cu.rc("cuIpcGetMemHandle", byref(gone), host.ctypes.data) == INVALID_VALUE
    freed = cu.alloc(64)
    cu("cuIpcGetMemHandle", byref(gone), freed)
    cu("cuMemFree_v2", freed)
    with child(_legacy_ipc_child, lib_path) as (proc, conn):
        conn.send((bytes(handle), bytes(gone), size))
        result = recv(conn)
    assert proc.exitcode == 0
    assert result["data"] == data and result["same_address"]
    assert result["flags_zero"] == INVALID_VALUE
    assert result["third_close"] == INVALID_VALUE
    assert result["freed"] == INVALID_HANDLE
    assert result["uuid"] == cu.uuid(0)  # same machine, same UUID
    assert result["opens"] == 1  # the second open was a reference
    assert cu.dtoh(base, 5) == b"reply"
    cu("cuMemFree_v2", base)


def _vmm_child(cu, conn):
    fd = reduction.recv_handle(conn)
    size, offset, n = conn.recv()
    handle = u64()
    cu("cuMemImportFromShareableHandle", byref(handle), fd, POSIX_FD)
    os.close(fd)  # the import made its own reference
    ptr = cu.vmm_map(handle.value, size)
    data = ctypes.string_at(ptr + offset, n)
    ctypes.memmove(ptr + size - 5, b"child", 5)
    cu.vmm_unmap(ptr, size)
    cu("cuMemRelease", handle.value)
    conn.send(data)


def test_vmm_export_import_across_processes(cu, lib_path):
    vmm = ("vmm_handles", "vmm_reservations", "vmm_mappings")
    before = [cu.stats()["live"][key] for key in vmm]
    granularity = c_size_t()
    for option in (0, 1):
        cu("cuMemGetAllocationGranularity", byref(granularity), byref(prop()), option)
        assert granularity.value == GRANULARITY
    handle = u64()
    for size in (GRANULARITY + 4096, 0):
        rc = cu.rc("cuMemCreate", byref(handle), size, byref(prop()), 0)
        assert rc == INVALID_VALUE
    fd = c_int()
    private = cu.vmm_create(GRANULARITY, handle_types=0)
    rc = cu.rc("cuMemExportToShareableHandle", byref(fd), private, POSIX_FD, 0)
    assert rc == INVALID_VALUE  # not created with a POSIX fd handle type
    cu("cuMemRelease", private)

    size = 2 * GRANULARITY
    shared = cu.vmm_create(size)
    cu("cuMemExportToShareableHandle", byref(fd), shared, POSIX_FD, 0)
    ptr = cu.vmm_map(shared, size)
    data = np.random.default_rng(2).bytes(10_000)
    ctypes.memmove(ptr + GRANULARITY - 7, data, len(data))
    with child(_vmm_child, lib_path) as (proc, conn):
        reduction.send_handle(conn, fd.value, proc.pid)
        conn.send((size, GRANULARITY - 7, len(data)))
        assert recv(conn) == data
    assert proc.exitcode == 0
    os.close(fd.value)  # the export's fd was ours to close
    assert ctypes.string_at(ptr + size - 5, 5) == b"child"
    cu("cuMemRelease", shared)  # the mapping keeps the memory
    assert ctypes.string_at(ptr + GRANULARITY - 7, 16) == data[:16]
    assert cu.rc("cuMemAddressFree", ptr, size) == INVALID_VALUE  # still mapped
    assert cu.rc("cuMemUnmap", ptr, GRANULARITY) == INVALID_VALUE  # part of one
    cu.vmm_unmap(ptr, size)
    assert [cu.stats()["live"][key] for key in vmm] == before


def test_peer_access_and_grants_for_two_devices(fresh):
    """Every two devices reach each other (an NVLink node) unless
    FAKE_CUDA_NO_PEER_ACCESS=1; a mapping opens to a second device only
    then (cuda_ipc's peer-to-peer landing asks for it)."""
    for no_peer in ("0", "1"):
        cu = fresh(FAKE_CUDA_DEVICES="2", FAKE_CUDA_NO_PEER_ACCESS=no_peer).setup()
        can = c_int(7)
        cu("cuDeviceCanAccessPeer", byref(can), 1, 0)
        assert can.value == (no_peer == "0")
        cu("cuDeviceCanAccessPeer", byref(can), 0, 0)
        assert can.value == 0  # not a peer of itself
        assert cu.rc("cuDeviceCanAccessPeer", byref(can), 0, 2) == INVALID_DEVICE
        ptr = cu.vmm_map(cu.vmm_create(GRANULARITY), GRANULARITY)  # device 0's
        second = AccessDesc(Location(1, 1), READWRITE)
        rc = cu.rc("cuMemSetAccess", ptr, GRANULARITY, byref(second), 1)
        assert rc == (SUCCESS if no_peer == "0" else INVALID_DEVICE)


def test_vmm_map_and_import_rules(cu):
    handle, other = cu.vmm_create(GRANULARITY), u64()
    ptr = u64()
    cu("cuMemAddressReserve", byref(ptr), 2 * GRANULARITY, 0, 0, 0)
    assert cu.rc("cuMemMap", ptr.value, GRANULARITY, 4096, handle, 0) == INVALID_VALUE
    assert cu.rc("cuMemMap", ptr.value, 2 * GRANULARITY, 0, handle, 0) == INVALID_VALUE
    cu("cuMemMap", ptr.value, GRANULARITY, 0, handle, 0)
    assert cu.rc("cuMemMap", ptr.value, GRANULARITY, 0, handle, 0) == INVALID_VALUE
    # Copies refuse VMM memory without access.
    host = np.zeros(8, np.uint8)
    assert cu.rc("cuMemcpyHtoD_v2", ptr.value, host.ctypes.data, 8) == INVALID_VALUE
    desc = AccessDesc(Location(1, 0), READWRITE)
    cu("cuMemSetAccess", ptr.value, GRANULARITY, byref(desc), 1)
    cu.htod(ptr.value, b"12345678")
    found, size = u64(), c_size_t()
    cu("cuMemGetAddressRange_v2", byref(found), byref(size), ptr.value + 3)
    assert (found.value, size.value) == (ptr.value, GRANULARITY)
    fd = c_int()
    cu("cuMemExportToShareableHandle", byref(fd), handle, POSIX_FD, 0)
    # The fd itself, not a pointer to it; and only one of the fake's memfds.
    pointer = ctypes.addressof(fd)
    assert cu.rc("cuMemImportFromShareableHandle", byref(other), pointer, 1) == (
        INVALID_VALUE
    )
    r, w = os.pipe()
    assert cu.rc("cuMemImportFromShareableHandle", byref(other), r, 1) == INVALID_VALUE
    for n in (fd.value, r, w):
        os.close(n)
    cu("cuMemUnmap", ptr.value, GRANULARITY)
    cu("cuMemAddressFree", ptr.value, 2 * GRANULARITY)
    cu("cuMemRelease", handle)
    assert cu.rc("cuMemRelease", handle) == INVALID_VALUE


def _fault_child(cu, conn):
    faulthandler.disable()  # die of the signal, quietly
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    when = conn.recv()
    handle = cu.vmm_create(GRANULARITY)
    if when == "before_set_access":
        ptr = cu.vmm_map(handle, GRANULARITY, access=False)
    else:
        ptr = cu.vmm_map(handle, GRANULARITY)
        ctypes.memmove(ptr, b"ok", 2)
        cu("cuMemUnmap", ptr, GRANULARITY)
    conn.send("touching")
    ctypes.string_at(ptr, 1)
    conn.send("survived")


@pytest.mark.not_sanitized("the child must die of SIGSEGV; ASan reports it and exits 1")
@pytest.mark.parametrize("when", ["before_set_access", "after_unmap"])
def test_vmm_memory_faults_without_access(lib_path, when):
    with child(_fault_child, lib_path) as (proc, conn):
        conn.send(when)
        assert recv(conn) == "touching"
        proc.join(60)
    assert proc.exitcode == -signal.SIGSEGV


def _event_waiter_child(cu, conn):
    memory, event, size = conn.recv()
    ptr, ev = u64(), c_void_p()
    cu("cuIpcOpenMemHandle_v2", byref(ptr), Handle.from_buffer_copy(memory), 1)
    cu("cuIpcOpenEventHandle", byref(ev), Handle.from_buffer_copy(event))
    conn.send("opened")
    assert conn.recv() == "recorded"
    s = cu.stream()
    out = np.zeros(size, np.uint8)
    cu("cuStreamWaitEvent", s, ev, 0)
    cu("cuMemcpyDtoHAsync_v2", out.ctypes.data, ptr.value, size, s)
    conn.send(("queued", cu.rc("cuEventQuery", ev)))
    cu("cuStreamSynchronize", s)
    conn.send(out.tobytes())
    cu("cuEventDestroy_v2", ev)
    cu("cuIpcCloseMemHandle", ptr.value)


def test_an_interprocess_event_orders_work_in_two_processes(cu, lib_path):
    size = 4096
    buf = cu.upload(bytes(size))
    ev = cu.event(EVENT_IPC)
    memory, event = Handle(), Handle()
    cu("cuIpcGetMemHandle", byref(memory), buf)
    cu("cuIpcGetEventHandle", byref(event), ev)
    data = np.frombuffer(np.random.default_rng(3).bytes(size), np.uint8)
    gate, s = threading.Event(), cu.stream()
    with child(_event_waiter_child, lib_path) as (proc, conn):
        conn.send((bytes(memory), bytes(event), size))
        assert recv(conn) == "opened"
        # Here: the data lands, then the event is recorded, behind the gate.
        cu.host_func(s, lambda: gate.wait(60))
        cu("cuMemcpyHtoDAsync_v2", buf, data.ctypes.data, size, s)
        cu("cuEventRecord", ev, s)
        conn.send("recorded")
        # There: a wait on the event, then a copy out, both queued.
        assert recv(conn) == ("queued", NOT_READY)
        assert not conn.poll(0.3)  # the child's stream is blocked
        gate.set()
        assert recv(conn) == data.tobytes()
    assert proc.exitcode == 0
    cu("cuStreamSynchronize", s)
    cu("cuStreamDestroy_v2", s)
    cu("cuEventDestroy_v2", ev)
    cu("cuMemFree_v2", buf)


def _poisoned_child(cu, conn):
    memory, event = conn.recv()
    ptr, ev = u64(), c_void_p()
    cu("cuIpcOpenMemHandle_v2", byref(ptr), Handle.from_buffer_copy(memory), 1)
    cu("cuIpcOpenEventHandle", byref(ev), Handle.from_buffer_copy(event))
    cu("cuEventQuery", ev)  # while the exporter has it: fine
    conn.send(cu.stats()["poisoned_uses"])
    assert conn.recv() == "destroyed and freed"
    s = cu.stream()
    cu("cuStreamWaitEvent", s, ev, 0)  # each use from now on is counted
    cu("cuEventQuery", ev)
    cu("cuEventDestroy_v2", ev)
    cu("cuIpcCloseMemHandle", ptr.value)
    conn.send(cu.stats()["poisoned_uses"])


def test_ipc_events_and_legacy_memory_are_poisoned_once_their_exporter_lets_go(cu, lib_path):
    """cuda.h calls it undefined to use an imported event after its
    exporter destroyed it, or to close a legacy mapping after the exporter
    freed the memory: the fake counts each such use in the importer."""
    buf = cu.alloc(4096)
    ev = cu.event(EVENT_IPC)
    memory, event = Handle(), Handle()
    cu("cuIpcGetMemHandle", byref(memory), buf)
    cu("cuIpcGetEventHandle", byref(event), ev)
    with child(_poisoned_child, lib_path) as (proc, conn):
        conn.send((bytes(memory), bytes(event)))
        assert recv(conn) == 0
        cu("cuEventDestroy_v2", ev)
        cu("cuMemFree_v2", buf)
        conn.send("destroyed and freed")
        # wait, query, destroy of the event; the close of the mapping.
        assert recv(conn) == 4
    assert proc.exitcode == 0
    assert cu.stats()["poisoned_uses"] == 0  # the exporter's own calls are fine


def test_a_global_capture_refuses_unsafe_calls_from_threads_not_relaxed(cu):
    """While a stream captures in global mode, a thread in global mode (the
    default) may not allocate, free, query or synchronise: the call fails
    and is counted; a thread that exchanged its mode for relaxed may."""
    cu.lib.fake_cuda_reset_stats()
    ev = cu.event(0)
    cu.lib.fake_cuda_set_global_capture(1)
    try:
        ptr = u64()
        refused = [cu.rc("cuMemAlloc_v2", byref(ptr), 64), cu.rc("cuEventQuery", ev)]
        mode = c_int(RELAXED)
        cu("cuThreadExchangeStreamCaptureMode", byref(mode))
        assert mode.value == GLOBAL  # what the thread had
        allowed = [cu.rc("cuMemAlloc_v2", byref(ptr), 64), cu.rc("cuEventQuery", ev),
                   cu.rc("cuMemFree_v2", ptr.value)]
        cu("cuThreadExchangeStreamCaptureMode", byref(mode))
        assert mode.value == RELAXED
    finally:
        cu.lib.fake_cuda_set_global_capture(0)
    assert refused == [STREAM_CAPTURE_UNSUPPORTED] * 2
    assert allowed == [SUCCESS] * 3
    assert cu.stats()["capture_violations"] == 2
    assert cu.rc("cuEventQuery", ev) == SUCCESS  # capture over
    bad = c_int(7)
    assert cu.rc("cuThreadExchangeStreamCaptureMode", byref(bad)) == INVALID_VALUE
    cu("cuEventDestroy_v2", ev)


# ------------------------------------------------------------- kernels


def _ptx(*entries, version="9.0", target="sm_75", params=3) -> bytes:
    """A PTX module of empty kernels with `params` .u64 parameters each."""
    text = f"//\n.version {version}\n.target {target}\n.address_size 64\n\n"
    for entry in entries:
        names = [f"\t.param .u64 {entry}_param_{i}" for i in range(params)]
        text += (
            f".visible .entry {entry}(\n" + ",\n".join(names) + "\n)\n{\n\tret;\n}\n"
        )
    return text.encode()


def _kernel_ptx() -> dict:
    """(entry, PTX) per kernel name: made by torch_rpc_ext._cuda.ptx (numba),
    or the copies in .gpu/ptx."""
    try:
        from torch_rpc_ext._cuda import ptx

        return {name: (k.entry, k.ptx) for name, k in ptx.kernel_ptx().items()}
    except ImportError:
        pass
    folder = ROOT / ".gpu" / "ptx"
    if not (folder / "kernels.json").is_file():
        pytest.skip("no PTX: numba-cuda is not installed and .gpu/ptx is absent")
    listing = json.loads((folder / "kernels.json").read_text())
    return {
        k["name"]: (k["entry"], (folder / k["file"]).read_text())
        for k in listing["kernels"]
    }


@pytest.fixture(scope="module")
def kernels(cu):
    """name -> CUfunction, from the real PTX of the copy kernels."""
    functions = {}
    for name, (entry, text) in _kernel_ptx().items():
        module, fn = c_void_p(), c_void_p()
        cu("cuModuleLoadData", byref(module), text.encode())
        cu("cuModuleGetFunction", byref(fn), module, entry.encode())
        functions[name] = fn
    assert sorted(functions) == [
        "copy_contiguous",
        "copy_segments",
        "pack_strided",
        "unpack_strided",
    ]
    return functions


def test_ptx_loading_rules(cu):
    module, fn = c_void_p(), c_void_p()
    load = lambda text: cu.rc("cuModuleLoadData", byref(module), text)  # noqa: E731
    entry = "_Z15copy_contiguousyyy"
    assert load(_ptx(entry, version="9.1")) == UNSUPPORTED_PTX_VERSION
    assert load(_ptx(entry, version="10.0")) == UNSUPPORTED_PTX_VERSION
    assert load(_ptx(entry, target="sm_100")) == INVALID_PTX
    assert load(_ptx()) == INVALID_PTX  # no entry
    assert load(b"// .visible .entry hidden(\n" + _ptx()) == INVALID_PTX
    assert load(b"not ptx") == INVALID_PTX
    assert load(b"\x7fELF\x02\x01") == INVALID_IMAGE
    before = cu.stats()["live"]["modules"]
    assert load(_ptx(entry, version="8.8")) == SUCCESS
    assert cu.rc("cuModuleGetFunction", byref(fn), module, entry[:-1].encode()) == (
        NOT_FOUND
    )
    cu("cuModuleGetFunction", byref(fn), module, entry.encode())
    cu("cuModuleUnload", module)
    assert cu.stats()["live"]["modules"] == before
    dst, src = cu.alloc(8), cu.alloc(8)
    assert cu.launch(fn, dst, src, 8) == INVALID_HANDLE  # its module is gone
    cu("cuMemFree_v2", dst)
    cu("cuMemFree_v2", src)


def test_an_older_driver_version_loads_older_ptx_only(fresh):
    """$FAKE_CUDA_DRIVER_VERSION=12040: cuDriverGetVersion says CUDA 12.4
    (before cuInit too, as the real one), and PTX newer than ISA 8.4 is
    refused as such a driver refuses it."""
    cu = fresh(FAKE_CUDA_DRIVER_VERSION="12040")
    version = c_int()
    assert cu.rc("cuDriverGetVersion", byref(version)) == SUCCESS and version.value == 12040
    cu.setup()
    module = c_void_p()
    entry = "_Z15copy_contiguousyyy"
    assert cu.rc("cuModuleLoadData", byref(module), _ptx(entry, version="8.5")) == (
        UNSUPPORTED_PTX_VERSION)
    assert cu.rc("cuModuleLoadData", byref(module), _ptx(entry, version="8.4")) == SUCCESS
    cu("cuModuleUnload", module)
    assert cu.rc("cuModuleLoadData", byref(module), _ptx(entry, version="6.0",
                                                          target="sm_70")) == SUCCESS
    cu("cuModuleUnload", module)


def test_kernels_are_told_apart_by_their_mangled_names(cu):
    module = c_void_p()
    unpack, pack, extra, unknown = (
        "_Z14unpack_stridedyyy",
        "_Z12pack_stridedyyy",
        "_Z15copy_contiguousyyyy",
        "_Z3fooyyy",
    )
    text = _ptx(unpack, pack, unknown) + _ptx(extra, params=4).split(b"\n\n", 1)[1]
    cu("cuModuleLoadData", byref(module), text)
    fns = {}
    for name in (unpack, pack, extra, unknown):
        fns[name] = c_void_p()
        cu("cuModuleGetFunction", byref(fns[name]), module, name.encode())
    desc = cu.upload(np.array([1, 1, 4, 4, 2], np.uint64).tobytes())  # 4 x stride 2
    strided, packed = cu.upload(b"abcdefgh"), cu.upload(b"WXYZ")
    out = cu.alloc(4)
    assert cu.launch(fns[pack], out, strided, desc) == SUCCESS
    assert cu.launch(fns[unpack], strided, packed, desc) == SUCCESS
    cu("cuStreamSynchronize", None)
    assert cu.dtoh(out, 4) == b"aceg" and cu.dtoh(strided, 8) == b"WbXdYfZh"
    assert cu.launch(fns[extra], out, strided, 4, 0) == NOT_SUPPORTED
    assert cu.launch(fns[unknown], out, strided, 4) == NOT_SUPPORTED
    cu("cuModuleUnload", module)
    for ptr in (desc, strided, packed, out):
        cu("cuMemFree_v2", ptr)


def test_launch_shapes_are_checked(cu, kernels):
    fn = kernels["copy_contiguous"]
    dst, src = cu.alloc(16), cu.alloc(16)
    for grid, block in (
        ((0, 1, 1), (32, 1, 1)),
        ((1, 1, 1), (0, 1, 1)),
        ((1, 1, 1), (1025, 1, 1)),
        ((1, 1, 1), (32, 32, 2)),
        ((1, 1, 1), (1, 1, 65)),
        ((1, 1 << 16, 1), (32, 1, 1)),
    ):
        assert cu.launch(fn, dst, src, 16, grid=grid, block=block) == INVALID_VALUE
    args = (c_void_p * 3)()
    assert (
        cu.rc("cuLaunchKernel", fn, 1, 1, 1, 32, 1, 1, 0, None, None, None)
        == INVALID_VALUE
    )
    assert cu.rc("cuLaunchKernel", fn, 1, 1, 1, 32, 1, 1, 0, None, args, args) == (
        NOT_SUPPORTED
    )
    assert cu.launch(fn, dst, src, 16, grid=(1, 1, 1), block=(1024, 1, 1)) == SUCCESS
    cu("cuStreamSynchronize", None)
    cu("cuMemFree_v2", dst)
    cu("cuMemFree_v2", src)


def test_copy_contiguous_matches_numpy(cu, kernels):
    rng = np.random.default_rng(4)
    capacity = MiB + 64
    src_bytes = rng.bytes(capacity)
    src, dst, s = cu.upload(src_bytes), cu.alloc(capacity), cu.stream()
    launches = cu.stats()["launches"]["copy_contiguous"]
    cases = [(n, 0, 0) for n in (0, 1, 15, 16, 17, 255, 4099)]
    cases += [(MiB + 3, 5, 3), (1000, 1, 16), (77, 9, 9), (4096, 8, 0)]
    for i, (n, dst_off, src_off) in enumerate(cases):
        before = rng.bytes(capacity)
        cu.htod(dst, before)
        grid, block = (i % 5 + 1, 1, 1), (32 * (i % 4 + 1), 1, 1)
        rc = cu.launch(
            kernels["copy_contiguous"],
            dst + dst_off,
            src + src_off,
            n,
            grid=grid,
            block=block,
            stream=s,
        )
        assert rc == SUCCESS
        cu("cuStreamSynchronize", s)
        expected = bytearray(before)
        expected[dst_off : dst_off + n] = src_bytes[src_off : src_off + n]
        assert cu.dtoh(dst, capacity) == bytes(expected), (n, dst_off, src_off)
    assert cu.stats()["launches"]["copy_contiguous"] == launches + len(cases)
    cu("cuStreamDestroy_v2", s)
    cu("cuMemFree_v2", src)
    cu("cuMemFree_v2", dst)


def test_copy_segments_gathers_scatters_and_checks_its_table(cu, kernels):
    from torch_rpc_ext._cuda import abi

    rng = np.random.default_rng(5)
    sizes = [int(n) for n in rng.integers(0, 3000, 300)]
    sizes[::37] = [0] * len(sizes[::37])
    total, chunk = sum(sizes), 512
    pool = rng.bytes(2 * total + 300)
    src, slab, back = cu.upload(pool), cu.alloc(total), cu.upload(bytes(len(pool)))
    # Gather: scattered pieces of src (odd offsets) into the slab, in order.
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    spread = [2 * o + i % 7 for i, o in enumerate(offsets)]
    gather = abi.segment_table(
        [(slab + o, src + p, n) for o, p, n in zip(offsets, spread, sizes)], chunk
    )
    table = cu.upload(gather.tobytes())
    fn = kernels["copy_segments"]
    assert cu.launch(fn, table, len(sizes), chunk, grid=(7, 1, 1)) == SUCCESS
    cu("cuStreamSynchronize", None)
    expected = b"".join(pool[p : p + n] for p, n in zip(spread, sizes))
    assert cu.dtoh(slab, total) == expected
    # Scatter: the slab back out to the same offsets of another buffer.
    scatter = abi.segment_table(
        [(back + p, slab + o, n) for o, p, n in zip(offsets, spread, sizes)], chunk
    )
    table2 = cu.upload(scatter.tobytes())
    assert cu.launch(fn, table2, len(sizes), chunk, grid=(64, 1, 1)) == SUCCESS
    cu("cuStreamSynchronize", None)
    result = cu.dtoh(back, len(pool))
    for p, n in zip(spread, sizes):
        assert result[p : p + n] == pool[p : p + n]
    # A wrong chunk_begin: a kernel error, nothing copied.
    errors = cu.stats()["kernel_errors"]
    broken = gather.copy()
    broken[5, abi.SEGMENT_CHUNK_BEGIN] += 1
    cu.htod(slab, bytes(total))
    table3 = cu.upload(broken.tobytes())
    assert cu.launch(fn, table3, len(sizes), chunk) == SUCCESS
    cu("cuStreamSynchronize", None)
    stats = cu.stats()
    assert stats["kernel_errors"] == errors + 1
    assert "row 5" in stats["last_kernel_error"]
    assert cu.dtoh(slab, total) == bytes(total)
    assert cu.launch(fn, table, 0, chunk) == SUCCESS  # count 0: nothing
    cu("cuStreamSynchronize", None)
    for ptr in (src, slab, back, table, table2, table3):
        cu("cuMemFree_v2", ptr)


DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.dtype("V16")}
VIEWS = {  # (base shape, view of it, whether it can be unpacked into)
    "contiguous": ((7, 9, 5), lambda a: a, True),
    "transposed": ((7, 9, 5), lambda a: a.transpose(2, 0, 1), True),
    "sliced": ((7, 9, 5), lambda a: a[1:6:2, ::3, 1:], True),
    "column": ((11, 13), lambda a: a[:, 4], True),
    "steps_1d": ((97,), lambda a: a[5::7], True),
    "mixed_4d": ((4, 5, 6, 7), lambda a: a[:, 1::2].transpose(3, 1, 0, 2), True),
    "scalar": ((5,), lambda a: a[2, ...], True),
    "empty": ((4, 5), lambda a: a[:, 2:2], True),
    "broadcast": ((3, 9), lambda a: np.broadcast_to(a[1, 2:8], (4, 6)), False),
}


@pytest.mark.parametrize("elem_size", sorted(DTYPES))
def test_pack_and_unpack_strided_match_numpy(cu, kernels, elem_size):
    from torch_rpc_ext._cuda import abi

    rng = np.random.default_rng(elem_size)
    dtype = DTYPES[elem_size]
    for name, (shape, make_view, unpackable) in VIEWS.items():
        nbytes = int(np.prod(shape)) * elem_size
        base = np.frombuffer(rng.bytes(nbytes), dtype).reshape(shape)
        view = make_view(base)
        delta = (
            view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        )
        strides = [s // elem_size for s in view.strides]
        desc = cu.upload(abi.strided_descriptor(view.shape, strides, elem_size))
        numel = int(np.prod(view.shape))
        strided, out = cu.upload(base.tobytes()), cu.alloc(max(numel * elem_size, 1))
        grid = (3, 1, 1)
        assert (
            cu.launch(kernels["pack_strided"], out, strided + delta, desc, grid=grid)
            == 0
        )
        cu("cuStreamSynchronize", None)
        packed = cu.dtoh(out, numel * elem_size)
        assert packed == np.ascontiguousarray(view).tobytes(), name
        if unpackable:
            values = rng.bytes(numel * elem_size)
            cu.htod(out, values)
            rc = cu.launch(kernels["unpack_strided"], strided + delta, out, desc)
            assert rc == SUCCESS
            cu("cuStreamSynchronize", None)
            expected = base.copy()
            make_view(expected)[...] = np.frombuffer(values, dtype).reshape(view.shape)
            assert cu.dtoh(strided, nbytes) == expected.tobytes(), name
        for ptr in (desc, strided, out):
            cu("cuMemFree_v2", ptr)


def test_strided_copies_record_misalignment_as_a_kernel_error(cu, kernels):
    from torch_rpc_ext._cuda import abi

    errors = cu.stats()["kernel_errors"]
    desc = cu.upload(abi.strided_descriptor([4], [1], 8))
    src, out = cu.upload(bytes(range(40))), cu.upload(bytes(32))
    assert cu.launch(kernels["pack_strided"], out, src + 4, desc) == SUCCESS
    cu("cuStreamSynchronize", None)
    stats = cu.stats()
    assert stats["kernel_errors"] == errors + 1
    assert "aligned" in stats["last_kernel_error"]
    assert cu.dtoh(out, 32) == bytes(32)
    for ptr in (desc, src, out):
        cu("cuMemFree_v2", ptr)


def test_a_memory_limit_makes_allocations_past_it_fail(fresh):
    """$FAKE_CUDA_MEM_LIMIT bounds the device memory a process holds
    (cuMemAlloc's, page-rounded, and cuMemCreate's): past it, out of memory;
    freeing makes room again."""
    cu = fresh(FAKE_CUDA_MEM_LIMIT=str(5 << 20)).setup()
    first = cu.alloc(3 << 20)
    ptr = u64()
    assert cu.rc("cuMemAlloc_v2", byref(ptr), 3 << 20) == OUT_OF_MEMORY
    handle = c_uint64()
    assert cu.rc("cuMemCreate", byref(handle), 4 << 20, byref(prop()), 0) == OUT_OF_MEMORY
    assert cu.stats()["live"]["device_bytes"] == 3 << 20
    cu("cuMemFree_v2", first)
    cu("cuMemCreate", byref(handle), 4 << 20, byref(prop()), 0)
    assert cu.stats()["live"]["device_bytes"] == 4 << 20
    assert cu.rc("cuMemAlloc_v2", byref(ptr), 2 << 20) == OUT_OF_MEMORY
    cu("cuMemRelease", handle)
    assert cu.stats()["live"]["device_bytes"] == 0


def test_stats_count_context_retains_per_device(fresh):
    cu = fresh(FAKE_CUDA_DEVICES="4").setup()  # retains device 0's
    dev, ctx = c_int(), c_void_p()
    cu("cuDeviceGet", byref(dev), 2)
    cu("cuDevicePrimaryCtxRetain", byref(ctx), dev)
    assert cu.stats()["live"]["context_retains_by_device"] == [1, 0, 1, 0]
    cu("cuDevicePrimaryCtxRelease_v2", dev)
    assert cu.stats()["live"]["context_retains_by_device"] == [1, 0, 0, 0]


def test_stats_count_and_reset(fresh):
    cu = fresh().setup()
    ptr = cu.alloc(100)
    cu.htod(ptr, b"x" * 100)
    assert cu.rc("cuMemFree_v2", ptr + 1) == INVALID_VALUE
    stats = cu.stats()
    assert stats["memcpys"] == 1 and stats["memcpy_bytes"] == 100
    assert stats["errors"] == 1 and "cuMemFree_v2" in stats["last_error"]
    assert stats["live"]["allocations"] == 1
    assert stats["live"]["context_retains"] == 1
    cu.lib.fake_cuda_reset_stats()
    stats = cu.stats()
    assert stats["memcpys"] == stats["errors"] == 0 and stats["last_error"] == ""
    assert stats["live"]["allocations"] == 1  # live objects are not counters
    buf = ctypes.create_string_buffer(8)
    n = cu.lib.fake_cuda_stats(buf, 8)
    assert n > 8 and len(buf.value) == 7  # truncated, NUL-terminated
    cu("cuMemFree_v2", ptr)


_BACKTRACE_CHILD = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
assert lib.cuInit(0) == 0
n, dev = ctypes.c_int(), ctypes.c_int()
assert lib.cuDeviceGetCount(ctypes.byref(n)) == 0
assert lib.cuDeviceGetCount(ctypes.byref(n)) == 0
assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
"""


def test_named_entry_points_print_the_stack_that_called_them(lib_path):
    """$FAKE_CUDA_BACKTRACE (a diagnostic: whose code a count in the stats
    comes from) prints a stack at each call of the entry points it names,
    and only of those."""
    done = subprocess.run(
        [sys.executable, "-c", _BACKTRACE_CHILD, str(lib_path)],
        env={**os.environ, "FAKE_CUDA_BACKTRACE": "cuDeviceGetCount,cuMemAlloc_v2"},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    heads = re.findall(r"fake_libcuda: backtrace of (\w+) \(pid \d+\)", done.stderr)
    assert heads == ["cuDeviceGetCount", "cuDeviceGetCount"], done.stderr
    # Frames follow each head: the fake's own entry point among them.
    assert done.stderr.count("libfake") + done.stderr.count("fake_libcuda") > 2, done.stderr
