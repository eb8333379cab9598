# SPDX-License-Identifier: BSD-3-Clause
"""Build torch_rpc_ext and its native core torch_rpc_ext._C.

The extension is built against the torch installed where it is built, and
only that torch can load it, so build without isolation:

    MAX_JOBS=2 pip install --no-build-isolation .        # or -e . for development
    pip wheel --no-build-isolation --no-deps -w dist .
    python -m build --no-isolation                        # sdist + wheel

DEBUG=1 builds with -O0 -g; SANITIZE=address|thread adds a sanitizer.
Objects are kept in build/temp-torch<version>-py<version>/, so the editable
install, a wheel and an in-place build of one tree compile each source once;
torch_rpc_ext/_build_info.py records the torch and the flags, and a change of
either relinks (and ninja recompiles what its command line changed).
"""

import glob
import importlib.util
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
NAME = "torch_rpc_ext"
VERSION = "0.1.0"
# The torch versions this release is tested with (README, "Install"): 2.13
# by CI, 2.11 (CUDA) known to build.
TORCH_REQUIREMENT = "torch>=2.11,<2.14"
# Commands that compile; the others (metadata, sdist) need neither torch
# nor a compiler.
BUILD_COMMANDS = {
    "build", "build_ext", "bdist", "bdist_wheel", "bdist_egg", "editable_wheel",
    "develop", "install",
}


# The test hooks (torch_rpc_ext._testing): a module of their own, linked
# against _C, built only with TORCH_RPC_EXT_BUILD_TESTING=1 (tools/setup_env.sh
# sets it), so a wheel never ships them.
TESTING_SOURCES = [
    "csrc/bindings/bind_testing.cpp",
    "csrc/bindings/bind_testing_cuda.cpp",
    "csrc/bindings/bind_testing_cuda_torch.cpp",
    "csrc/bindings/bind_testing_endpoint.cpp",
    "csrc/bindings/testing_module.cpp",
]


def sources() -> list[str]:
    files = glob.glob("csrc/**/*.cpp", recursive=True)
    files += glob.glob("scripting/*.cpp")
    return sorted(set(files) - set(TESTING_SOURCES))


def headers() -> list[str]:
    # Listed as the extension's depends: setuptools relinks (and ninja
    # recompiles what includes them) when only a header changed.
    return sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("scripting/*.h"))


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


BUILD_INFO = os.path.join(NAME, "_build_info.py")


def write_build_info(torch) -> None:
    """torch_rpc_ext/_build_info.py: the torch this build is for (which
    ``import torch_rpc_ext`` compares with the torch it finds) and how it was
    built. Rewritten only when that changes; every extension depends on it,
    so a new torch or new flags relink what build/lib already holds."""
    text = (
        "# Written by setup.py at build time; not tracked.\n"
        f"TORCH_VERSION = {str(torch.__version__)!r}\n"
        f"BUILD_FLAGS = {(compile_args(), link_args())!r}\n"
    )
    path = os.path.join(ROOT, BUILD_INFO)
    old = open(path).read() if os.path.exists(path) else None
    if old != text:
        with open(path, "w") as f:
            f.write(text)


def cuda_include_args() -> list[str]:
    """-isystem for cuda.h (types and ABI names only: csrc/common/libcuda.h
    loads the driver at run time), or exit saying how to get it."""
    path = os.path.join(ROOT, NAME, "_cuda", "headers.py")
    spec = importlib.util.spec_from_file_location("_torch_rpc_ext_headers", path)
    headers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(headers)
    include = headers.cuda_include_dir()
    if include is None:
        sys.exit(
            "torch_rpc_ext needs cuda.h to build (one build serves CPU and CUDA "
            f"torch; no GPU and no CUDA library is needed): {headers.HOW_TO_GET}."
        )
    return ["-isystem", str(include)]


def import_torch():
    """torch and its extension helpers, or exit naming the supported build."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        sys.exit(
            "torch_rpc_ext is built against the torch it will run with, and no torch "
            "is importable here. Install torch first, then build without build "
            "isolation (an isolated build cannot see it):\n"
            f"    pip install '{TORCH_REQUIREMENT}'\n"
            "    pip install --no-build-isolation ."
        )
    return torch, cpp_extension


def build_command(cpp_extension, tag: str, testing: bool):
    """torch's BuildExtension with our object folder, the test hooks' link
    against _C, and no stale test hooks in a user's build."""

    class Build(cpp_extension.BuildExtension):
        def finalize_options(self) -> None:
            super().finalize_options()
            # One object folder per torch and Python, whoever builds
            # (pip's editable and wheel builds each pass a temporary one).
            self.build_temp = os.path.join(ROOT, "build", f"temp-{tag}")
            self.parallel = None  # _testing links against _C: in order

        def run(self) -> None:
            if not testing:
                # A build with the hooks left them in build/lib, which a
                # wheel would pack: a user's build never ships them.
                pattern = os.path.join(self.build_lib, NAME, "_testing.*")
                for stale in glob.glob(pattern):
                    os.remove(stale)
            super().run()

        def build_extension(self, ext) -> None:
            if ext.name == f"{NAME}._testing":
                # Linked against _C (built first) where it lands, found
                # beside it at run time.
                core = self.get_ext_fullpath(f"{NAME}._C")
                ext.library_dirs = [*ext.library_dirs, os.path.dirname(core)]
                ext.extra_link_args = [
                    *link_args(), f"-l:{os.path.basename(core)}", "-Wl,-rpath,$ORIGIN"
                ]
            super().build_extension(ext)

    return Build


def extensions() -> tuple[list, dict]:
    """The extensions and the build command, for commands that compile."""
    if not BUILD_COMMANDS & set(sys.argv[1:]):
        return [], {}
    torch, cpp_extension = import_torch()
    testing = os.environ.get("TORCH_RPC_EXT_BUILD_TESTING") == "1"
    write_build_info(torch)
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"

    cuda_args = cuda_include_args()

    def extension(name: str, files: list[str]):
        return cpp_extension.CppExtension(
            f"{NAME}.{name}",
            files,
            depends=[*headers(), BUILD_INFO],
            include_dirs=[ROOT],
            extra_compile_args=compile_args() + cuda_args,
            extra_link_args=link_args(),
            libraries=["torch_python"],
        )

    exts = [extension("_C", sources())]
    if testing:
        exts.append(extension("_testing", TESTING_SOURCES))
    return exts, {"build_ext": build_command(cpp_extension, tag, testing)}


ext_modules, cmdclass = extensions()
setup(
    name=NAME,
    version=VERSION,
    description="A fast, authenticated RPC backend for torch.distributed.rpc",
    packages=find_packages(include=[NAME, f"{NAME}.*"]),
    # The launcher's start-up hook: a folder put on PYTHONPATH, not a package.
    package_data={NAME: ["_launch/sitecustomize.py"]},
    python_requires=">=3.10",
    install_requires=[TORCH_REQUIREMENT],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
