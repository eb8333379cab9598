# SPDX-License-Identifier: BSD-3-Clause
"""A fake CUDA driver for tests: fake_libcuda.cpp, built on demand.

The library exports the driver entry points csrc/common/libcuda.h loads, under
cuda.h's ABI names, with host memory for device memory (see the comment at the
top of fake_libcuda.cpp for what it models and what not). Point the extension
at it with ``TORCH_RPC_EXT_LIBCUDA=<build()>``; environment variables the fake
reads at cuInit: FAKE_CUDA_DEVICES (default 1), FAKE_CUDA_UUID_SALT (another
salt, another machine), FAKE_CUDA_NO_VMM=1, FAKE_CUDA_IPC_SELF=1 (IPC handles
open in their own process too), FAKE_CUDA_TRACE=1 (print every error).
``fake_cuda_stats(char*, size_t)`` in the library writes a JSON object of
counters; test_fake_driver.py shows it read with ctypes.

Importing this module imports neither torch nor torch_rpc_ext.
"""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["CXXFLAGS", "SOURCE", "BuildError", "build"]

_ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).with_name("fake_libcuda.cpp")
CXXFLAGS = ("-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-pthread")
# Under tools/sanitize.sh thread the fake is built with TSan too.
# Uninstrumented, its streams' and events' ordering (atomics, its stream
# threads) is invisible to TSan, so every copy a stream thread makes reads as
# racing with the host; instrumented, TSan judges our code against the
# ordering the fake models, as a GPU would enforce it (docs/development.md,
# "The suites under a sanitizer").
if os.environ.get("SANITIZE") == "thread":
    CXXFLAGS += ("-fsanitize=thread",)
# Exports the driver's names and the test hooks only (no C++ runtime symbols
# that could interpose on the extension's).
_VERSION_SCRIPT = "{ global: cu*; fake_cuda_*; local: *; };\n"


class BuildError(RuntimeError):
    """cuda.h or g++ is missing, or the library did not compile."""


def _cuda_include_dir() -> Path:
    # By path: importing torch_rpc_ext._cuda would import torch_rpc_ext,
    # which needs the built extension.
    path = _ROOT / "torch_rpc_ext" / "_cuda" / "headers.py"
    spec = importlib.util.spec_from_file_location("_cuda_fake_headers", path)
    headers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(headers)
    include = headers.cuda_include_dir()
    if include is None:
        raise BuildError(
            f"the fake CUDA driver needs cuda.h to build: {headers.HOW_TO_GET}"
        )
    return include


def build(out_dir: Path | None = None) -> Path:
    """The fake driver's shared library, compiled unless already there.

    Args:
        out_dir: Where to keep it (default: build/cuda_fake in the checkout).
            The file name carries a hash of the source, cuda.h, the compiler
            and its flags, so a change rebuilds and concurrent builds agree;
            it is written to a temporary file and renamed.

    Returns:
        The path of the library (fake_libcuda-<hash>.so).

    Raises:
        BuildError: cuda.h or g++ is missing, or compiling failed.
    """
    include = _cuda_include_dir()
    cxx = shutil.which("g++")
    if cxx is None:
        raise BuildError("the fake CUDA driver needs g++ to build: not on PATH")
    compiler = subprocess.run(
        [cxx, "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[:1]
    digest = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        (include / "cuda.h").read_bytes(),
        " ".join((*compiler, *CXXFLAGS, _VERSION_SCRIPT)).encode(),
    ):
        digest.update(hashlib.sha256(part).digest())
    out_dir = Path(out_dir) if out_dir is not None else _ROOT / "build" / "cuda_fake"
    target = out_dir / f"fake_libcuda-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        script = Path(tmp) / "exports.map"
        script.write_text(_VERSION_SCRIPT)
        library = Path(tmp) / target.name
        command = [
            cxx,
            *CXXFLAGS,
            f"-I{include}",
            f"-Wl,--version-script={script}",
            str(SOURCE),
            "-o",
            str(library),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BuildError(
                f"compiling the fake CUDA driver failed:\n{' '.join(command)}\n"
                f"{done.stderr}"
            )
        os.replace(library, target)
    return target


if __name__ == "__main__":
    print(build())
