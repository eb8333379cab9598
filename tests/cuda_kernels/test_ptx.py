# SPDX-License-Identifier: BSD-3-Clause
"""The kernels compile to PTX with no GPU, in the shape C++ loads and launches:
one ``.visible .entry`` each, the parameters abi.KERNELS lists, all ``.u64``,
an sm_75 target and a PTX ISA that CUDA 13.0 drivers accept; and the on-disk
cache is hit, keyed by version, and written whole."""

import importlib
import importlib.metadata
import json
import re
import sys

import pytest

from torch_rpc_ext._cuda import NUMBA_REQUIREMENTS, abi, ptx

# The newest PTX ISA a CUDA 13.0 driver (the GPU machine's 580) loads.
DRIVER_MAX_ISA = (9, 0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An empty cache directory, filled by the first kernel_ptx() (a compile)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_RPC_EXT_CACHE_DIR", str(root))
        yield root / "ptx"


@pytest.fixture(scope="module")
def compiled(cache):
    assert not cache.exists()
    return ptx.kernel_ptx()


def test_every_kernel_has_one_entry_with_its_u64_parameters(compiled):
    assert list(compiled) == [spec.name for spec in abi.KERNELS]
    for spec in abi.KERNELS:
        k = compiled[spec.name]
        assert re.findall(r"^\.visible \.entry (\S+)\($", k.ptx, re.M) == [k.entry]
        assert spec.name in k.entry  # numba's mangling keeps the Python name
        assert k.params == ("u64",) * len(spec.params) == ("u64",) * 3
        params = re.findall(
            rf"^\s*\.param \.u64 {re.escape(k.entry)}_param_\d+", k.ptx, re.M
        )
        assert len(params) == len(spec.params)


def test_ptx_targets_sm75_and_an_isa_cuda13_drivers_load(compiled):
    for k in compiled.values():
        assert re.search(r"^\.target sm_75$", k.ptx, re.M) and k.target == "sm_75"
        assert re.search(r"^\.address_size 64$", k.ptx, re.M)
        version = re.search(r"^\.version (\d+)\.(\d+)$", k.ptx, re.M)
        assert (int(version[1]), int(version[2])) <= DRIVER_MAX_ISA
        assert k.isa == f"{version[1]}.{version[2]}"


def test_ptx_is_self_contained_and_integer_only(compiled):
    for k in compiled.values():
        # Nothing to link: cuModuleLoadData takes the text as it is.
        assert ".extern" not in k.ptx and "call." not in k.ptx, k.name
        # Index math stays in 64-bit integers (a signed operand mixed with a
        # uint64 would make numba compare in float64).
        assert not re.search(r"\.f(16|32|64)\b", k.ptx), k.name


def test_copies_use_16_byte_vectors_and_strided_copies_natural_widths(compiled):
    for name in ("copy_contiguous", "copy_segments"):
        text = compiled[name].ptx
        assert "ld.global.v2.u64" in text and "st.global.v2.u64" in text, name
    for name in ("pack_strided", "unpack_strided"):
        widths = set(re.findall(r"st\.global\.u(\d+)", compiled[name].ptx))
        assert widths == {"8", "16", "32", "64"}, name


def test_second_call_reads_the_cache_without_compiling(compiled, cache, monkeypatch):
    def no_compile(cc):
        raise AssertionError("compiled again")

    monkeypatch.setattr(ptx, "_compile", no_compile)
    assert ptx.kernel_ptx() == compiled
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 1 and files[0].endswith(".json"), files  # no temp left


def test_cache_is_keyed_by_versions_target_and_sources(compiled, cache, monkeypatch):
    stored = {name: k.ptx for name, k in compiled.items()}
    calls = []

    def fake_compile(cc):
        calls.append(cc)
        return stored

    monkeypatch.setattr(ptx, "_compile", fake_compile)
    key = ptx.cache_key()
    # The installed versions; "system" for a libnvvm from CUDA_HOME or the
    # loader's path (a GPU machine's toolkit, no nvidia-nvvm wheel).
    assert key["numba-cuda"] == importlib.metadata.version("numba-cuda")
    try:
        assert key["nvidia-nvvm"] == importlib.metadata.version("nvidia-nvvm")
    except importlib.metadata.PackageNotFoundError:
        assert key["nvidia-nvvm"] == "system"
    assert key["cc"] == "7.5" and len(key["sources"]) == 64
    versions = {"numba-cuda": "0.30.5", "nvidia-nvvm": key["nvidia-nvvm"]}
    monkeypatch.setattr(ptx, "_versions", lambda: versions)
    ptx.kernel_ptx()
    ptx.kernel_ptx()
    assert calls == [(7, 5)]  # a miss for the new version, then a hit
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_cache_file_is_made_again(compiled, cache, monkeypatch):
    path = next(cache.iterdir())
    stored = {name: k.ptx for name, k in compiled.items()}
    monkeypatch.setattr(ptx, "_compile", lambda cc: stored)
    for damage in ("", "{", json.dumps({"key": {}, "ptx": {}})):
        path.write_text(damage)
        assert ptx.kernel_ptx() == compiled


def test_cli_writes_ptx_files_and_a_manifest(compiled, tmp_path):
    out = tmp_path / "out"
    ptx.main(["--out", str(out)])  # python -m torch_rpc_ext._cuda.ptx --out DIR
    manifest = json.loads((out / "kernels.json").read_text())
    assert manifest["key"]["cc"] == "7.5"
    for spec, row in zip(abi.KERNELS, manifest["kernels"], strict=True):
        k = compiled[spec.name]
        assert (row["name"], row["entry"]) == (k.name, k.entry)
        assert row["params"] == list(k.params)
        assert row["param_names"] == list(spec.params)
        assert (out / row["file"]).read_text() == k.ptx


def test_without_numba_the_package_imports_and_says_what_to_install(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba fails
    package = sys.modules["torch_rpc_ext._cuda"]
    for name in ("abi", "ptx", "_memory", "kernels"):  # imported afresh below
        monkeypatch.delitem(sys.modules, f"{package.__name__}.{name}", raising=False)
        monkeypatch.delattr(package, name, raising=False)
    monkeypatch.setenv("TORCH_RPC_EXT_CACHE_DIR", str(tmp_path))
    importlib.import_module("torch_rpc_ext._cuda.abi")
    fresh_ptx = importlib.import_module("torch_rpc_ext._cuda.ptx")
    for load in (
        fresh_ptx.kernel_ptx,
        lambda: importlib.import_module("torch_rpc_ext._cuda.kernels"),
    ):
        with pytest.raises(ImportError, match=re.escape(NUMBA_REQUIREMENTS)):
            load()
