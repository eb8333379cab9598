# SPDX-License-Identifier: BSD-3-Clause
"""The PTX the package ships (torch_rpc_ext/_cuda/shipped_ptx/, issue 36 item 7): the
kernels lowered to PTX ISA 6.0 and sm_70, so that any driver from CUDA 9.0 on
loads them and numba-cuda is not needed to move CUDA tensors. They must be
current (made from today's kernels), agree with their manifest, and
assemble: ptxas 12.0 (the last with Volta) for sm_70 to sm_90, ptxas 13.0
for sm_75 to sm_120, both from NVIDIA's wheels (nvidia-cuda-nvcc)."""

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from torch_rpc_ext._cuda import abi, ptx

ROOT = Path(__file__).resolve().parents[2]
PTXAS_DIR = ROOT / "build" / "ptxas"
# wheel requirement, the ptxas member in it, the architectures to assemble
PTXAS = {
    "12.0": ("nvidia-cuda-nvcc-cu12==12.0.140", "nvidia/cuda_nvcc/bin/ptxas",
             ["sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90"]),
    "13.0": ("nvidia-cuda-nvcc==13.0.88", "nvidia/cu13/bin/ptxas",
             ["sm_75", "sm_80", "sm_90", "sm_100", "sm_120"]),
}
REMAKE = "remake them: python -m torch_rpc_ext._cuda.ptx --ship"


def _code(text: str) -> tuple[list[str], list[str]]:
    """PTX without its comment lines (NVVM's banner names its build), with
    numba's per-process counters in mangled names (`B2v1B`: the function's
    uid) made equal, and its `.common` declarations apart and sorted (their
    order follows the order numba first compiled the device functions in,
    which depends on what the process did before): the rest of each name,
    and the code, must agree."""
    lines = [re.sub(r"B\d+v\d+B", "BvB", line) for line in text.splitlines()
             if not line.startswith("//")]
    common = sorted(line for line in lines if line.startswith(".common"))
    return common, [line for line in lines if not line.startswith(".common")]


def test_the_shipped_ptx_is_lowered_and_agrees_with_its_manifest():
    shipped = ptx.shipped_ptx()
    assert shipped is not None, "no torch_rpc_ext/_cuda/shipped_ptx/kernels.json: " + REMAKE
    assert list(shipped) == [spec.name for spec in abi.KERNELS]
    manifest = json.loads((ptx.shipped_dir() / "kernels.json").read_text())
    rows = {row["name"]: row for row in manifest["kernels"]}
    for name, k in shipped.items():
        assert (k.isa, k.target) == ("6.0", "sm_70")
        assert re.findall(r"^\.version (\S+)$", k.ptx, re.M) == ["6.0"]
        assert rows[name]["entry"] == k.entry and rows[name]["isa"] == "6.0"
        assert rows[name]["params"] == list(k.params)
    assert manifest["key"]["kernel_sources"] == ptx.kernel_sources_hash(), (
        "the kernels' sources changed since the shipped PTX was made: " + REMAKE)


def test_the_shipped_ptx_is_what_numba_makes_of_todays_kernels(tmp_path, monkeypatch):
    pytest.importorskip("numba.cuda", reason="numba-cuda remakes the PTX")
    monkeypatch.setenv("TORCH_RPC_EXT_CACHE_DIR", str(tmp_path))
    made = ptx.kernel_ptx()
    for name, k in ptx.shipped_ptx().items():
        assert _code(ptx.lower(made[name].ptx)) == _code(k.ptx), f"{name}: " + REMAKE


def test_lowering_rewrites_the_version_and_the_target_only():
    text = "// c\n.version 9.0\n.target sm_75\n.address_size 64\n\tadd.s64 %rd1, %rd2, 1;\n"
    assert ptx.lower(text) == (
        "// c\n.version 6.0\n.target sm_70\n.address_size 64\n\tadd.s64 %rd1, %rd2, 1;\n")
    with pytest.raises(ValueError, match="exactly one"):
        ptx.lower(".target sm_75\n")


def _ptxas(version: str) -> Path:
    """ptxas of that CUDA release, taken from NVIDIA's wheel (downloaded once
    into build/ptxas/); skips where the registry cannot be reached."""
    requirement, member, _ = PTXAS[version]
    out = PTXAS_DIR / version / "ptxas"
    if out.exists():
        return out
    wheels = PTXAS_DIR / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
         requirement], capture_output=True, text=True, timeout=600, check=False)
    name = requirement.split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{name}-*.whl"))
    if got.returncode != 0 or not found:
        pytest.skip(f"ptxas {version}: pip download {requirement} failed: {got.stderr[-300:]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[-1]) as z:
        out.write_bytes(z.read(member))
    out.chmod(0o755)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("version", sorted(PTXAS))
def test_ptxas_assembles_the_shipped_ptx_for_every_architecture(version, tmp_path):
    tool = _ptxas(version)
    for name, k in ptx.shipped_ptx().items():
        source = tmp_path / f"{name}.ptx"
        source.write_text(k.ptx)
        for arch in PTXAS[version][2]:
            done = subprocess.run([str(tool), f"-arch={arch}", str(source), "-o", "/dev/null"],
                                  capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, f"ptxas {version} -arch={arch} {name}: {done.stderr}"
