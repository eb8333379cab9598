# SPDX-License-Identifier: BSD-3-Clause
"""Calling a module's functions in another process (a spawned pool worker),
for tests whose subject must not load into the pytest process: numba's
simulator (tests/cuda_kernels), a CUDA driver (tests/cuda_driver)."""

from concurrent.futures import ProcessPoolExecutor
from types import ModuleType


class Remote:
    """``remote.f(*args)`` runs ``module.f(*args)`` in the pool's process."""

    def __init__(self, pool: ProcessPoolExecutor, module: ModuleType, timeout: float = 300):
        self._pool = pool
        self._module = module
        self._timeout = timeout

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)
        return lambda *args: self._pool.submit(fn, *args).result(timeout=self._timeout)
