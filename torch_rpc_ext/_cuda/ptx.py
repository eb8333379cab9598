# SPDX-License-Identifier: BSD-3-Clause
"""The copy kernels as PTX, made without a GPU and cached on disk.

``kernel_ptx()`` returns, per kernel of abi.KERNELS, the PTX text, the mangled
``.visible .entry`` name to pass to ``cuModuleGetFunction`` and the parameter
types (all ``u64``). The first call compiles (numba-cuda + libnvvm, about a
second per kernel, no GPU and no driver); later calls read the cache:
``$TORCH_RPC_EXT_CACHE_DIR`` else ``~/.cache/torch_rpc_ext/ptx/``, one JSON
file per key (numba-cuda version, nvidia-nvvm version, compute capability,
hash of this package's sources), written to a temporary file and renamed.
A cache hit imports no numba.

The target is sm_75: the oldest that CUDA 13's NVVM still accepts (it rejects
compute_70), so the PTX JIT-compiles on Turing and every newer GPU. NVVM
13.0 writes ``.version 9.0``, which only CUDA 13.0 drivers (R580) load.

What the package ships and loads is that PTX lowered (``lower()``): the
kernels use nothing newer than PTX ISA 5.0 (``.common`` globals; the rest
is integer arithmetic, branches, global loads and stores), so the shipped
files say ``.version 6.0`` and ``.target sm_70``, the lowest pair ptxas
accepts for Volta, and load on any driver from CUDA 9.0 (R384) on, every
GPU from sm_70 on. They live in ``torch_rpc_ext/_cuda/shipped_ptx/`` with a
manifest (``kernels.json``: entries, parameters, ISA, target, the versions
that compiled them and a hash of the kernels' sources);
tests/cuda_kernels/test_shipped_ptx.py checks they are current and
assembles them with ptxas 12.0 (sm_70 to sm_90) and 13.0 (sm_75 to
sm_120). numba-cuda is needed only to remake them (the ``[cuda]`` extra).

Command line: ``python -m torch_rpc_ext._cuda.ptx --out DIR`` writes
DIR/<kernel>.ptx and DIR/kernels.json as NVVM made them; ``--ship``
remakes the package's shipped, lowered files.
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from torch_rpc_ext._cuda import abi, missing_numba

__all__ = [
    "DEFAULT_CC",
    "KernelPtx",
    "cache_dir",
    "cache_key",
    "kernel_ptx",
    "parse_entry",
    "write_dir",
]

DEFAULT_CC = (7, 5)
# What the shipped PTX says (lower()).
SHIPPED_ISA = "6.0"
SHIPPED_TARGET = "sm_70"
# The sources the kernels are made from (what the shipped files' hash covers).
KERNEL_SOURCES = ("abi.py", "kernels.py", "_memory.py", "_memory_nvvm.py")
_FORMAT = 1  # bump when the cache file's layout changes
_ENTRY = re.compile(r"^\.visible \.entry (\S+)\($", re.MULTILINE)
_PARAM = re.compile(r"^\s*\.param \.(\w+) (\S+?),?$", re.MULTILINE)
_VERSION = re.compile(r"^\.version (\S+)$", re.MULTILINE)
_TARGET = re.compile(r"^\.target (\S+)$", re.MULTILINE)
_compile_lock = threading.Lock()


@dataclass(frozen=True)
class KernelPtx:
    """One compiled kernel, as C++ loads and launches it."""

    name: str  # abi.KernelSpec.name
    entry: str  # the mangled name after ".visible .entry"
    params: tuple[str, ...]  # PTX parameter types in order: ("u64", ...)
    isa: str  # the PTX ISA version (".version"), e.g. "9.0"
    target: str  # ".target", e.g. "sm_75"
    ptx: str


def cache_dir() -> Path:
    """Where compiled PTX is kept (``$TORCH_RPC_EXT_CACHE_DIR`` or ~/.cache)."""
    if root := os.environ.get("TORCH_RPC_EXT_CACHE_DIR"):
        return Path(root) / "ptx"
    return Path.home() / ".cache" / "torch_rpc_ext" / "ptx"


def _versions() -> dict[str, str]:
    try:
        numba_cuda = importlib.metadata.version("numba-cuda")
    except importlib.metadata.PackageNotFoundError:
        raise missing_numba("making the copy kernels' PTX") from None
    try:
        nvvm = importlib.metadata.version("nvidia-nvvm")
    except importlib.metadata.PackageNotFoundError:
        nvvm = "system"  # libnvvm from CUDA_HOME or the loader's path
    return {"numba-cuda": numba_cuda, "nvidia-nvvm": nvvm}


def _sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def kernel_sources_hash() -> str:
    """A hash of the files the kernels are compiled from."""
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        path = Path(__file__).parent / name
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def shipped_dir() -> Path:
    """Where the package keeps its lowered PTX."""
    return Path(__file__).parent / "shipped_ptx"


def lower(ptx: str) -> str:
    """NVVM's PTX with ``.version`` SHIPPED_ISA and ``.target``
    SHIPPED_TARGET (the kernels need nothing newer: see the module's
    docstring; ptxas checks it in tests)."""
    text, n = _VERSION.subn(f".version {SHIPPED_ISA}", ptx)
    text, m = _TARGET.subn(f".target {SHIPPED_TARGET}", text)
    if n != 1 or m != 1:
        raise ValueError("PTX without exactly one .version and one .target")
    return text


def shipped_ptx() -> dict[str, KernelPtx] | None:
    """The package's lowered PTX by kernel name, in abi.KERNELS order, or
    None where the package has none (a checkout whose files were removed).

    Raises:
        ValueError: The files do not agree with their manifest or abi.KERNELS.
    """
    manifest_path = shipped_dir() / "kernels.json"
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    rows = {row["name"]: row for row in manifest["kernels"]}
    result = {}
    for spec in abi.KERNELS:
        if spec.name not in rows:
            raise ValueError(f"{manifest_path}: no kernel {spec.name}")
        text = (shipped_dir() / rows[spec.name]["file"]).read_text()
        result[spec.name] = _describe(spec, text)
        if result[spec.name].entry != rows[spec.name]["entry"]:
            raise ValueError(f"{spec.name}: entry differs from {manifest_path}")
    return result


def _describe(spec: "abi.KernelSpec", text: str) -> KernelPtx:
    entry, params = parse_entry(text)
    if params != ("u64",) * len(spec.params):
        raise ValueError(f"{spec.name}: parameters {params}, want {spec.params}")
    isa, target = _VERSION.search(text).group(1), _TARGET.search(text).group(1)
    return KernelPtx(spec.name, entry, params, isa, target, text)


def cache_key(cc: tuple[int, int] = DEFAULT_CC) -> dict[str, str]:
    """What a cached PTX file must match: versions, target, sources."""
    return {
        **_versions(),
        "cc": f"{cc[0]}.{cc[1]}",
        "sources": _sources_hash(),
        "format": str(_FORMAT),
    }


def _cache_file(key: dict[str, str]) -> Path:
    text = json.dumps(key, sort_keys=True).encode()
    return cache_dir() / f"kernels-{hashlib.sha256(text).hexdigest()[:20]}.json"


def write_atomically(path: Path, text: str) -> None:
    """Write text to path so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def parse_entry(ptx: str) -> tuple[str, tuple[str, ...]]:
    """The one ``.visible .entry`` of a PTX module: its name, its param types.

    Raises:
        ValueError: There is not exactly one entry.
    """
    entries = _ENTRY.findall(ptx)
    if len(entries) != 1:
        raise ValueError(f"expected one .visible .entry, found {entries}")
    start = ptx.index(f".visible .entry {entries[0]}(")
    block = ptx[start : ptx.index(")", start)]
    return entries[0], tuple(m.group(1) for m in _PARAM.finditer(block))


class _CompileTarget:
    """Stands in for the current device, which numba-cuda asks for the compute
    capability of every device function a kernel calls, even in compile_ptx.
    (numba keeps a device function compiled once per process; nothing in
    these depends on the target until NVVM, which gets cc from compile_ptx.)"""

    def __init__(self, cc: tuple[int, int]) -> None:
        self.compute_capability = cc


def _compile(cc: tuple[int, int]) -> dict[str, str]:
    """PTX per kernel name; imports numba (and raises ImportError if missing)."""
    from unittest import mock

    try:
        from numba import cuda
        from numba.cuda import dispatcher, types
    except ImportError as e:
        raise missing_numba("making the copy kernels' PTX") from e
    if cuda.config.ENABLE_CUDASIM:
        raise RuntimeError("PTX cannot be made under NUMBA_ENABLE_CUDASIM=1")
    from torch_rpc_ext._cuda import kernels

    out = {}
    target = _CompileTarget(cc)
    with (
        _compile_lock,
        mock.patch.object(dispatcher, "get_current_device", lambda: target),
    ):
        for spec in abi.KERNELS:
            sig = (types.uint64,) * len(spec.params)
            ptx, _ = cuda.compile_ptx(getattr(kernels, spec.name), sig, cc=cc)
            out[spec.name] = ptx
    return out


def kernel_ptx(cc: tuple[int, int] = DEFAULT_CC) -> dict[str, KernelPtx]:
    """Every kernel of abi.KERNELS as PTX for compute capability cc, cached.

    Returns:
        KernelPtx by kernel name, in abi.KERNELS order.

    Raises:
        ImportError: numba-cuda is not installed (the message says what to
            install).
        ValueError: A compiled kernel's entry or parameters are not what
            abi.KERNELS says.
    """
    key = cache_key(cc)
    path = _cache_file(key)
    try:
        stored = json.loads(path.read_text())
        if stored["key"] != key:
            raise ValueError("key mismatch")
        ptx = stored["ptx"]
    except (OSError, ValueError, KeyError, TypeError):
        ptx = _compile(cc)
        write_atomically(path, json.dumps({"key": key, "ptx": ptx}, sort_keys=True))
    return {spec.name: _describe(spec, ptx[spec.name]) for spec in abi.KERNELS}


def write_dir(out: Path, cc: tuple[int, int] = DEFAULT_CC, lowered: bool = False) -> Path:
    """DIR/<kernel>.ptx per kernel and DIR/kernels.json describing them
    (`lowered`: as the package ships them)."""
    kernels = kernel_ptx(cc)
    if lowered:
        kernels = {name: _describe(spec, lower(kernels[name].ptx))
                   for spec in abi.KERNELS for name in [spec.name]}
    manifest = {"key": {**cache_key(cc), "kernel_sources": kernel_sources_hash()},
                "kernels": []}
    del manifest["key"]["sources"]  # the package's: not what the files depend on
    for spec in abi.KERNELS:
        k = kernels[spec.name]
        write_atomically(out / f"{k.name}.ptx", k.ptx)
        row = {key: value for key, value in asdict(k).items() if key != "ptx"}
        manifest["kernels"].append(
            {**row, "param_names": list(spec.params), "file": f"{k.name}.ptx"}
        )
    path = out / "kernels.json"
    write_atomically(path, json.dumps(manifest, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="output directory")
    where.add_argument("--ship", action="store_true",
                       help="remake the package's shipped, lowered PTX")
    parser.add_argument(
        "--cc", default="{}.{}".format(*DEFAULT_CC), help="compute capability"
    )
    args = parser.parse_args(argv)
    major, minor = (int(part) for part in args.cc.split("."))
    if args.ship:
        print(write_dir(shipped_dir(), (major, minor), lowered=True))
    else:
        print(write_dir(args.out, (major, minor)))


if __name__ == "__main__":
    main()
