# SPDX-License-Identifier: BSD-3-Clause
"""Shared test setup: markers by folder, GPU skips, skips under a sanitizer,
the CPU each test used (tests/cpu_use.py)."""

import pytest
import torch

import torch_rpc_ext  # noqa: F401  (registers the backend before any fork)
from tests.build_flags import SANITIZER

pytest_plugins = ("tests.cpu_use",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        unsanitized = item.get_closest_marker("not_sanitized")
        if SANITIZER and unsanitized and SANITIZER in unsanitized.kwargs.get(
                "kinds", ("address", "thread")):
            why = unsanitized.kwargs.get("reason") or unsanitized.args[0]
            item.add_marker(pytest.mark.skip(reason=f"under the {SANITIZER} sanitizer: {why}"))
        path = str(item.fspath)
        if "/unit/" in path:
            item.add_marker(pytest.mark.unit)
        elif "/rpc/" in path:
            item.add_marker(pytest.mark.rpc)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def launched_tmpdir(tmp_path, monkeypatch):
    """TMPDIR, for the processes a test starts, inside the test's tmp_path.

    torchrun (and our launcher, which runs on it) makes a log folder,
    /tmp/torchelastic_*, per launch and leaves it there; pytest removes
    old tmp_paths. The pytest process keeps its own temporary directory
    (tempfile caches it at first use)."""
    tmp = tmp_path / "launched-tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp
