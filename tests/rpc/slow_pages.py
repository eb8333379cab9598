# SPDX-License-Identifier: BSD-3-Clause
"""Memory whose pages come in slowly, as a memory-mapped file's do from
storage that takes its time (a network file system, a disk spun down):
anonymous pages registered with a userfaultfd of ours, which the kernel
asks us for when a thread first reads one. We answer `delay` seconds after
the first ask, with every page at once. Needs userfaultfd (root, or
vm.unprivileged_userfaultfd=1); a test skips without it. x86_64 Linux.

Only threads that do not hold the GIL may read the memory (the thread
answering is a Python one): here, the C++ threads of the extension."""

import ctypes
import mmap
import os
import threading
import time

import pytest

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

SYS_USERFAULTFD = 323  # x86_64
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api: 24 bytes)
UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register: 32)
UFFDIO_COPY = 0xC028AA03  # _IOWR(0xAA, 0x03, struct uffdio_copy: 40)
UFFDIO_REGISTER_MODE_MISSING = 1
UFFD_MSG_BYTES = 32


class SlowPages:
    """`size` bytes at `address`, which read as `expected` once given."""

    def __init__(self, size, delay):
        self.size = size
        self.delay = delay
        self.expected = (bytes(range(251)) * (size // 251 + 1))[:size]
        self.asked_at = None
        self._source = ctypes.create_string_buffer(self.expected, size)
        self.fd = _libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC)
        if self.fd < 0:
            pytest.skip("no userfaultfd here: %s" % os.strerror(ctypes.get_errno()))
        address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        self.address = address
        api = (ctypes.c_uint64 * 3)(UFFD_API, 0, 0)
        self._check(_libc.ioctl(self.fd, UFFDIO_API, ctypes.addressof(api)), "UFFDIO_API")
        reg = (ctypes.c_uint64 * 4)(address, size, UFFDIO_REGISTER_MODE_MISSING, 0)
        self._check(_libc.ioctl(self.fd, UFFDIO_REGISTER, ctypes.addressof(reg)),
                    "UFFDIO_REGISTER")
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _check(self, rc, what):
        if rc != 0:
            err = ctypes.get_errno()
            self.close()
            pytest.skip("userfaultfd %s failed here: %s" % (what, os.strerror(err)))

    def _serve(self):
        try:
            os.read(self.fd, UFFD_MSG_BYTES)  # the first ask (blocks until one)
        except OSError:
            return  # closed before anyone asked
        self.asked_at = time.monotonic()
        time.sleep(self.delay)
        # Every page at once; the copy wakes every thread waiting on one.
        copy = (ctypes.c_uint64 * 5)(self.address, ctypes.addressof(self._source), self.size,
                                     0, 0)
        _libc.ioctl(self.fd, UFFDIO_COPY, ctypes.addressof(copy))

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)  # (unregisters the range)
            self.fd = -1
        if getattr(self, "address", None):
            _libc.munmap(self.address, self.size)
            self.address = None
