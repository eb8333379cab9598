# SPDX-License-Identifier: BSD-3-Clause
"""Build torch_rpc_ext and its native core torch_rpc_ext._C.

MAX_JOBS=2 pip install --no-build-isolation -e .
DEBUG=1 builds with -O0 -g; SANITIZE=address|thread adds a sanitizer.
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources() -> list[str]:
    files = glob.glob("csrc/**/*.cpp", recursive=True)
    files += glob.glob("scripting/*.cpp")
    return sorted(files)


def compile_args() -> list[str]:
    args = ["-std=c++20", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    if os.environ.get("DEBUG") == "1":
        args += ["-O0", "-g"]
    else:
        args += ["-O2"]
    if sanitizer := os.environ.get("SANITIZE"):
        args += [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer"]
    return args


def link_args() -> list[str]:
    if sanitizer := os.environ.get("SANITIZE"):
        return [f"-fsanitize={sanitizer}"]
    return []


setup(
    name="torch_rpc_ext",
    version="0.1.0",
    description="A fast, authenticated RPC backend for torch.distributed.rpc",
    packages=find_packages(include=["torch_rpc_ext", "torch_rpc_ext.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.13,<2.15"],
    ext_modules=[
        CppExtension(
            "torch_rpc_ext._C",
            sources(),
            include_dirs=[ROOT],
            extra_compile_args=compile_args(),
            extra_link_args=link_args(),
            libraries=["torch_python"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
