# SPDX-License-Identifier: BSD-3-Clause
"""The simulator worker shared by this folder's tests (see sim_worker.py)."""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.cuda_kernels import sim_worker


class Simulator:
    """Calls sim_worker functions in the simulator process."""

    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self._pool = pool

    def __getattr__(self, name: str):
        fn = getattr(sim_worker, name)
        return lambda *args: self._pool.submit(fn, *args).result(timeout=300)


@pytest.fixture(scope="session")
def sim():
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, context, initializer=sim_worker.start) as pool:
        yield Simulator(pool)
