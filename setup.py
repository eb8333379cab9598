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


def load_by_path(name: str, relative: str):
    """A module of the package that needs no torch, loaded before the package
    exists (and where torch may be missing)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The torch releases this release is tested with (docs/development.md,
# "Other torch versions").
TORCH_RANGE = load_by_path("_torch_rpc_ext_range", f"{NAME}/_torch_range.py")
TORCH_REQUIREMENT = TORCH_RANGE.REQUIREMENT
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
    "csrc/bindings/bind_testing_agent.cpp",
    "csrc/bindings/bind_testing_cuda.cpp",
    "csrc/bindings/bind_testing_cuda_torch.cpp",
    "csrc/bindings/bind_testing_endpoint.cpp",
    "csrc/bindings/bind_testing_membership.cpp",
    "csrc/bindings/fake_caching_allocator.cpp",
    "csrc/bindings/testing_grants.cpp",
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
    elif os.environ.get("SANITIZE") == "thread":
        # The ThreadSanitizer tree (tools/sanitize.sh), built in every clean
        # run of the suite: -O1, as TSan's docs allow, compiles its units a
        # fifth faster than -O2 (docs/development.md, "Build time").
        args += ["-O1", "-g0"]
    else:
        # Python's own CFLAGS, which setuptools puts first, carry -g: debug
        # info for torch's templates was 40% of a build and 97% of the
        # objects' size (docs/development.md, "Build time").
        args += ["-O2", "-g0"]
    if sanitizer := os.environ.get("SANITIZE"):
        args += [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer"]
    return args


# Unity build: the sources of a folder compile as a few translation units
# (at most UNITY_FILES sources each) that #include them, because parsing
# and instantiating torch's headers, once per source, was most of the build
# (docs/development.md, "Build time"). Names private to a source (anonymous
# namespaces) must therefore differ across its folder; the compiler says so
# when they do not. TORCH_RPC_EXT_UNITY=N puts up to N sources in a unit
# (tools/setup_env.sh gives a tree of another torch's, or the sanitizer's,
# one unit per folder: built from clean once per run, they need no small
# units for quick rebuilds); TORCH_RPC_EXT_UNITY=0 compiles each source
# alone, which also proves each includes what it uses.
UNITY_FILES = 8


def unity_files() -> int:
    """Sources per unity unit: TORCH_RPC_EXT_UNITY, else UNITY_FILES."""
    value = os.environ.get("TORCH_RPC_EXT_UNITY", "")
    if not value:
        return UNITY_FILES
    if not value.isdigit():
        sys.exit(f"setup.py: TORCH_RPC_EXT_UNITY is a count of sources per unit (0: none), not {value!r}")
    return int(value)


def unity_sources(files: list[str], folder: str) -> list[str]:
    """The translation units for ``files``: a generated source in ``folder``
    per group of at most unity_files() from one source folder (a source alone
    in its folder stays as it is). A unit is rewritten only when its list
    changes, so ninja recompiles a unit when one of its sources changed."""
    per_unit = unity_files()
    if per_unit == 0:
        return list(files)
    groups: dict[str, list[str]] = {}
    for f in sorted(files):
        groups.setdefault(os.path.dirname(f), []).append(f)
    units = []
    os.makedirs(folder, exist_ok=True)
    for source_dir, members in sorted(groups.items()):
        count = -(-len(members) // per_unit)
        if len(members) == 1:
            units += members
            continue
        for i in range(count):
            chunk = members[i * len(members) // count:(i + 1) * len(members) // count]
            text = "// Generated by setup.py: a unity translation unit.\n" + "".join(
                f'#include "{f}"\n' for f in chunk
            )
            unit = os.path.join(folder, f"{source_dir.replace('/', '_')}_{i}.cpp")
            old = open(unit).read() if os.path.exists(unit) else None
            if old != text:
                with open(unit, "w") as f:
                    f.write(text)
            units.append(unit)
    return units


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
    headers = load_by_path("_torch_rpc_ext_headers", f"{NAME}/_cuda/headers.py")
    include = headers.cuda_include_dir()
    if include is None:
        sys.exit(
            "torch_rpc_ext needs cuda.h to build (one build serves CPU and CUDA "
            f"torch; no GPU and no CUDA library is needed): {headers.HOW_TO_GET}."
        )
    args = ["-isystem", str(include)]
    crt = headers.crt_include_dir()
    if crt is not None and crt != include:
        args += ["-isystem", str(crt)]
    if crt is None:
        print(
            "torch_rpc_ext: no crt/host_config.h (pip install 'nvidia-cuda-crt==13.0.*'): "
            "built without the CUDA landing pool's routing"
        )
    # After torch's own headers: what a CPU torch lacks for c10/cuda's.
    return args + ["-idirafter", os.path.join(ROOT, "csrc", "shim")]


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
    if not TORCH_RANGE.in_range(torch.__version__) and os.environ.get(TORCH_RANGE.ALLOW_ENV) != "1":
        sys.exit(
            f"torch_rpc_ext {VERSION} is tested with {TORCH_RANGE.range_text()}, and "
            f"torch {torch.__version__} is installed here. Install a torch in that range "
            f"first, or set {TORCH_RANGE.ALLOW_ENV}=1 to build against this one anyway."
        )
    return torch, cpp_extension


def built_torch() -> str | None:
    """The torch a wheel or an install built here is for: the importable one,
    for every command but sdist (an sdist is for any torch in the range)."""
    if "sdist" in sys.argv[1:] or importlib.util.find_spec("torch") is None:
        return None
    import torch  # its __version__ has the local tag (2.15.0+cu132), its metadata may not

    return str(torch.__version__)


def package_version(torch_version: str | None) -> str:
    """VERSION, with the torch a build is for as its local label (a wheel
    built against torch 2.15.0+cu132 is 0.1.0+torch2.15.0.cu132), so its
    name says which torch it runs with. pip computes the metadata and builds
    the wheel in two calls: both must give the same answer, and do, since
    both see the same torch."""
    if torch_version is None:
        return VERSION
    return f"{VERSION}+torch{torch_version.replace('+', '.')}"


def torch_requirement(torch_version: str | None) -> str:
    """A build runs only with the torch it was compiled against: it requires
    that release (as torchvision's wheels do); an sdist, the tested range."""
    if torch_version is None:
        return TORCH_REQUIREMENT
    return f"torch=={torch_version.split('+')[0]}"


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

        def build_extensions(self) -> None:
            # The linker is the C++ driver with the link flags setuptools
            # took from Python's build (distutils' rule for a C++ target).
            linker = list(self.compiler.linker_so)
            if getattr(self.compiler, "compiler_cxx", None):
                linker[0] = self.compiler.compiler_cxx[0]
            toolchain = load_by_path("_torch_rpc_ext_toolchain", f"{NAME}/_toolchain.py")
            flags, what = toolchain.libstdcxx_link_args(linker)
            if what:
                print(f"torch_rpc_ext: {what}", file=sys.stderr)
            self.libstdcxx_flags = flags
            super().build_extensions()

        def build_extension(self, ext) -> None:
            if not hasattr(ext, "own_sources"):
                ext.own_sources = list(ext.sources)
                # setuptools skips an extension newer than its sources and
                # depends: the units' sources are the real ones.
                ext.depends = [*ext.depends, *ext.own_sources]
            unity = os.path.relpath(os.path.join(self.build_temp, "unity"), ROOT)
            ext.sources = unity_sources(ext.own_sources, os.path.join(unity, ext.name))
            if ext.name == f"{NAME}._testing":
                # Linked against _C (built first) where it lands, found
                # beside it at run time.
                core = self.get_ext_fullpath(f"{NAME}._C")
                ext.library_dirs = [*ext.library_dirs, os.path.dirname(core)]
                ext.extra_link_args = [
                    *link_args(), *self.libstdcxx_flags,
                    f"-l:{os.path.basename(core)}", "-Wl,-rpath,$ORIGIN",
                ]
            else:
                ext.extra_link_args = [*link_args(), *self.libstdcxx_flags]
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
BUILT_TORCH = built_torch()
setup(
    name=NAME,
    version=package_version(BUILT_TORCH),
    description="A fast, authenticated RPC backend for torch.distributed.rpc",
    packages=find_packages(include=[NAME, f"{NAME}.*"]),
    # The launcher's start-up hook: a folder put on PYTHONPATH, not a package;
    # the copy kernels' PTX (torch_rpc_ext/_cuda/ptx.py), shipped so that
    # CUDA tensors move without numba-cuda.
    package_data={
        NAME: ["_launch/sitecustomize.py", "_cuda/shipped_ptx/*.ptx", "_cuda/shipped_ptx/kernels.json"]
    },
    python_requires=">=3.10",
    install_requires=[torch_requirement(BUILT_TORCH)],
    # numba-cuda remakes the shipped PTX (python -m torch_rpc_ext._cuda.ptx
    # --ship) and runs the kernels' simulator tests; nothing else needs it.
    extras_require={
        "metrics": ["prometheus_client"],
        "tracing": ["opentelemetry-api"],
        "cuda": ["numba", "numba-cuda==0.30.4", "nvidia-nvvm==13.0.*",
                 "nvidia-cuda-nvrtc==13.0.*"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
