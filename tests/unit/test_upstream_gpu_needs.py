# SPDX-License-Identifier: BSD-3-Clause
"""tests/conformance_cuda/gpus.py: the GPUs an upstream CUDA RPC test needs,
read from its skip_if_lt_x_gpu decorators, so that on a machine with fewer
the test skips where it is collected instead of after spawning four
processes. Upstream's own decorators and suites, no GPU needed."""

import functools

from torch.testing._internal.common_distributed import skip_if_lt_x_gpu
from torch.testing._internal.distributed.rpc_utils import (
    GENERIC_CUDA_TESTS,
    TENSORPIPE_CUDA_TESTS,
)

from tests.conformance_cuda.gpus import gpus_needed, skip_beyond


def passthrough(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def test_the_count_is_read_through_other_decorators():
    @passthrough
    @skip_if_lt_x_gpu(2)
    @passthrough
    def two(self):
        pass

    @skip_if_lt_x_gpu(4)
    @skip_if_lt_x_gpu(1)
    def four(self):
        pass

    def none(self):
        pass

    assert (gpus_needed(two), gpus_needed(four), gpus_needed(none)) == (2, 4, 0)


def suites_by_need() -> dict[int, list[str]]:
    by_need: dict[int, list[str]] = {}
    for suite in [*GENERIC_CUDA_TESTS, *TENSORPIPE_CUDA_TESTS]:
        for name in dir(suite):
            if name.startswith("test_"):
                by_need.setdefault(gpus_needed(getattr(suite, name)), []).append(name)
    return by_need


def test_upstreams_suites_split_into_one_gpu_tests_and_more():
    by_need = suites_by_need()
    one_gpu = by_need.get(0, []) + by_need.get(1, [])
    # The tests an H200 ran (42 on torch 2.11; docs/cuda.md) are among them.
    assert {"test_device_map_cpu_to_gpu_default", "test_device_maps_missing_config",
            "test_rref_to_here_synchronization1", "test_tensor_view_as_return_value"} <= set(one_gpu)
    assert "test_device_maps_gpu" in by_need.get(2, [])
    assert len(one_gpu) >= 40 and sum(len(v) for k, v in by_need.items() if k > 1) >= 50


def test_only_the_tests_beyond_the_machine_are_skipped():
    suite = next(s for s in TENSORPIPE_CUDA_TESTS if hasattr(s, "test_device_maps_gpu"))
    # A subclass of the suite, as generate_tests makes: upstream's class stays as it is.
    ours = type("Ours", (suite,), {})
    skipped = skip_beyond([ours], 1)
    assert skipped >= 1
    beyond = ours.test_device_maps_gpu
    assert getattr(beyond, "__unittest_skip__", False)
    assert "needs 2 GPUs; this machine has 1" in beyond.__unittest_skip_why__
    assert not getattr(ours.test_device_map_gpu_to_cpu_default, "__unittest_skip__", False)
    assert not getattr(suite.test_device_maps_gpu, "__unittest_skip__", False)
