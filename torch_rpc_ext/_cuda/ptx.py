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
13.0 writes ``.version 9.0``, which CUDA 13.0 drivers load.

Command line (a build step, or the GPU machine):
``python -m torch_rpc_ext._cuda.ptx --out DIR`` writes DIR/<kernel>.ptx and
DIR/kernels.json (entry names, parameters, versions).
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
    result = {}
    for spec in abi.KERNELS:
        entry, params = parse_entry(ptx[spec.name])
        if params != ("u64",) * len(spec.params):
            raise ValueError(f"{spec.name}: parameters {params}, want {spec.params}")
        text = ptx[spec.name]
        isa, target = _VERSION.search(text).group(1), _TARGET.search(text).group(1)
        result[spec.name] = KernelPtx(spec.name, entry, params, isa, target, text)
    return result


def write_dir(out: Path, cc: tuple[int, int] = DEFAULT_CC) -> Path:
    """DIR/<kernel>.ptx per kernel and DIR/kernels.json describing them."""
    kernels = kernel_ptx(cc)
    manifest = {"key": cache_key(cc), "kernels": []}
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
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--cc", default="{}.{}".format(*DEFAULT_CC), help="compute capability"
    )
    args = parser.parse_args(argv)
    major, minor = (int(part) for part in args.cc.split("."))
    print(write_dir(args.out, (major, minor)))


if __name__ == "__main__":
    main()
