# SPDX-License-Identifier: BSD-3-Clause
"""The simulator worker shared by this folder's tests (see sim_worker.py)."""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.cuda_kernels import sim_worker
from tests.remote import Remote


@pytest.fixture(scope="session")
def sim():
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, context, initializer=sim_worker.start) as pool:
        yield Remote(pool, sim_worker)
