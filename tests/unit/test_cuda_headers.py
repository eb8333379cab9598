# SPDX-License-Identifier: BSD-3-Clause
"""Where the build finds cuda.h (torch_rpc_ext/_cuda/headers.py, which
setup.py loads by path), and what setup.py says when it finds none."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def load_headers():
    path = ROOT / "torch_rpc_ext" / "_cuda" / "headers.py"
    spec = importlib.util.spec_from_file_location("headers_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cuda_home_comes_first(tmp_path, monkeypatch):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda.h").write_text("/* stand-in */\n")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert load_headers().cuda_include_dir() == tmp_path / "include"


def test_the_wheel_is_found_without_cuda_home(monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    found = load_headers().cuda_include_dir()
    assert found is not None and (found / "cuda.h").is_file()  # setup_env.sh installs it
    assert "nvidia" in found.parts


def test_setup_stops_naming_the_wheel_when_cuda_h_is_missing(tmp_path):
    # setup.py's build path with no CUDA_HOME and no nvidia package visible.
    code = f"""
import importlib.util, os, sys
os.environ.pop("CUDA_HOME", None); os.environ.pop("CUDA_PATH", None)
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "nvidia" else real(name, *a)
sys.argv = ["setup.py", "build_ext"]
spec = importlib.util.spec_from_file_location("setup_under_test", {str(ROOT / "setup.py")!r})
setup = importlib.util.module_from_spec(spec)
import setuptools
setuptools.setup = lambda **kw: None
spec.loader.exec_module(setup)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode != 0
    assert "needs cuda.h to build" in out.stderr
    assert "nvidia-cuda-runtime==13.0.*" in out.stderr
