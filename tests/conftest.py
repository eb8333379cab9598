# SPDX-License-Identifier: BSD-3-Clause
"""Shared test setup: markers by folder, GPU skips."""

import pytest
import torch

import torch_rpc_ext  # noqa: F401  (registers the backend before any fork)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if "/unit/" in path:
            item.add_marker(pytest.mark.unit)
        elif "/rpc/" in path:
            item.add_marker(pytest.mark.rpc)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
