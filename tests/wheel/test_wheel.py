# SPDX-License-Identifier: BSD-3-Clause
"""torch_rpc_ext as users install it: a wheel built from this tree, installed
into a fresh virtual environment, used from a directory outside the checkout.

The wheel is built once per run (pip wheel --no-build-isolation reuses this
tree's objects in build/temp-*: it compiles nothing the tree has built). The fresh
environment gets torch from the test's own environment through a .pth file
(no download, no copy) and nothing of torch_rpc_ext but the wheel.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
import torch

from tests.rpc.world import free_port

# torchrun leaves a log folder per launch in TMPDIR: launched_tmpdir
# (tests/conftest.py) puts it in tmp_path.
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("launched_tmpdir")]

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ROOT / "tests" / "launcher" / "programs"
HOOK = "torch_rpc_ext/_launch/sitecustomize.py"


def _run(cmd, cwd, env=None, timeout=300, ok=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )
    if ok:
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    env.pop("TORCH_RPC_EXT_BUILD_TESTING", None)  # a user's build: no test hooks
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation",
          "--no-deps", "-w", out, ROOT], cwd=ROOT, env=env, timeout=500)
    (whl,) = out.glob("torch_rpc_ext-*.whl")
    return whl


def _borrowing_venv(base: Path, borrow_from: Path) -> tuple[Path, Path, dict]:
    """A fresh venv in ``base`` whose packages (torch and its dependencies,
    and pip) are those of ``borrow_from``, linked one by one: torch_rpc_ext's
    own entries (an editable install) left out. Returns its python, its
    site-packages and an environment that points nowhere near the checkout."""
    prefix = base / "venv"
    venv.EnvBuilder(with_pip=False).create(prefix)
    python = prefix / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=base).stdout.strip())
    borrowed = base / "borrowed"
    borrowed.mkdir()
    for entry in borrow_from.iterdir():
        if not entry.name.lower().startswith(("torch_rpc_ext", "__editable__")):
            (borrowed / entry.name).symlink_to(entry)
    (site / "borrowed.pth").write_text(f"{borrowed}\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "TORCH_RPC_EXT", "VIRTUAL_ENV"))}
    env["PATH"] = f"{prefix / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return python, site, env


@pytest.fixture(scope="module")
def user_env(tmp_path_factory, wheel) -> dict:
    """A fresh venv with the wheel installed, torch borrowed, and an
    environment that points nowhere near the checkout."""
    base = tmp_path_factory.mktemp("user")
    python, site, env = _borrowing_venv(base, Path(sysconfig.get_path("purelib")))
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], cwd=base)
    work = base / "work"
    work.mkdir()
    return {"python": python, "env": env, "cwd": work, "site": site}


def test_the_wheel_ships_the_core_and_the_launchers_hook(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert HOOK in names
    assert any(re.fullmatch(r"torch_rpc_ext/_C\..*\.so", n) for n in names)
    assert "torch_rpc_ext/_build_info.py" in names
    assert not [n for n in names if n.startswith("torch_rpc_ext/_testing")]  # test hooks stay home
    assert not [n for n in names if n.startswith(("tests/", "csrc/", "benchmarks/"))]
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    # Built for this torch and no other: its name says which, and it
    # requires that release; numba-cuda only with the [cuda] extra (it
    # remakes the shipped PTX, which CUDA tensors need, not numba).
    plain = [r for r in requires if "extra ==" not in r]
    assert plain == [f"Requires-Dist: torch=={torch.__version__.split('+')[0]}"], requires
    assert any(r.startswith("Requires-Dist: numba-cuda") and 'extra == "cuda"' in r
               for r in requires), requires
    shipped = {n for n in names if n.startswith("torch_rpc_ext/_cuda/shipped_ptx/")}
    assert shipped == {f"torch_rpc_ext/_cuda/shipped_ptx/{f}" for f in (
        "kernels.json", "copy_contiguous.ptx", "copy_segments.ptx", "pack_strided.ptx",
        "unpack_strided.ptx")}, shipped
    label = "torch" + torch.__version__.replace("+", ".")
    assert wheel.name.startswith(f"torch_rpc_ext-0.1.0+{label}-"), wheel.name


def test_installed_package_is_the_wheels(user_env):
    out = _run([user_env["python"], "-c", "import torch_rpc_ext; print(torch_rpc_ext.__file__)"],
               cwd=user_env["cwd"], env=user_env["env"])
    assert Path(out.stdout.strip()).is_relative_to(user_env["site"]), out.stdout
    assert (user_env["site"] / HOOK).is_file()


def test_launcher_switches_workers_started_with_mp_spawn(user_env, tmp_path):
    program = tmp_path / "spawned.py"
    program.write_text((PROGRAMS / "spawned.py").read_text())
    proc = _run([user_env["python"], "-m", "torch_rpc_ext.run", program, free_port()],
                cwd=user_env["cwd"], env=user_env["env"], timeout=240)
    rows = sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [(r["rank"], r["agent"], r["value"]) for r in rows] == [
        (0, "Agent", 10), (1, "Agent", 11)
    ], proc.stderr[-3000:]
    switched = [line for line in proc.stderr.splitlines()
                if line.startswith("torch_rpc_ext.run: worker ")]
    assert len(switched) == 2, proc.stderr[-3000:]
    assert all("asked for no backend with TensorPipeRpcBackendOptions; "
               "runs BackendType.TORCH_RPC_EXT" in line for line in switched)
    # TORCH_RPC_EXT_LOG=error: the same launch, silent.
    quiet = _run([user_env["python"], "-m", "torch_rpc_ext.run", program, free_port()],
                 cwd=user_env["cwd"], env=dict(user_env["env"], TORCH_RPC_EXT_LOG="error"),
                 timeout=240)
    assert "torch_rpc_ext" not in quiet.stderr, quiet.stderr[-2000:]


def test_launched_programs_get_the_hook_not_site_packages_on_their_path(user_env, tmp_path):
    # Another Python the program starts (a tool, another version) must not
    # be pointed at this environment's site-packages.
    program = tmp_path / "path.py"
    program.write_text("import os; print(os.environ['PYTHONPATH'])\n")
    out = _run([user_env["python"], "-m", "torch_rpc_ext.run", program],
               cwd=user_env["cwd"], env=user_env["env"], timeout=120)
    assert out.stdout.strip() == str(user_env["site"] / "torch_rpc_ext" / "_launch")


def test_plain_init_rpc_with_the_backend(user_env):
    code = f"""
import torch, torch.distributed.rpc as rpc, torch_rpc_ext
rpc.init_rpc("solo", rank=0, world_size=1, backend=rpc.BackendType.TORCH_RPC_EXT,
             rpc_backend_options=torch_rpc_ext.RpcExtBackendOptions(
                 init_method="tcp://127.0.0.1:{free_port()}"))
print(type(rpc.api._get_current_rpc_agent()).__name__,
      rpc.rpc_sync("solo", torch.add, args=(torch.ones(2), 1)).tolist())
rpc.shutdown()
"""
    out = _run([user_env["python"], "-c", code], cwd=user_env["cwd"], env=user_env["env"],
               timeout=120)
    assert out.stdout.split() == ["Agent", "[2.0,", "2.0]"], out.stdout


def _import_with_torch_version(user_env, version: str, env: dict | None = None) -> str:
    """The last line of what importing torch_rpc_ext prints where torch says
    it is ``version`` (the import fails)."""
    code = f"import torch; torch.__version__ = {version!r}; import torch_rpc_ext"
    out = _run([user_env["python"], "-c", code], cwd=user_env["cwd"],
               env={**user_env["env"], **(env or {})}, ok=False, timeout=120)
    assert out.returncode != 0
    return out.stderr.strip().splitlines()[-1]


def test_another_torch_gets_a_clear_error(user_env):
    other = "2.14.1+other" if not torch.__version__.startswith("2.14.") else "2.13.0+other"
    last = _import_with_torch_version(user_env, other)
    assert last.startswith("ImportError: torch_rpc_ext was built against torch "
                           f"{torch.__version__}, but torch {other} is running"), last
    assert "pip install --no-build-isolation" in last


def test_a_torch_outside_the_tested_range_is_named_with_the_range(user_env):
    last = _import_with_torch_version(user_env, "2.99.0")
    assert last.startswith("ImportError: torch_rpc_ext 0.1.0 is tested with torch>=2.11,<2.16 "
                           "(tested: "), last
    assert f"torch 2.99.0 is running (this build is for torch {torch.__version__})" in last
    assert "TORCH_RPC_EXT_ALLOW_UNTESTED_TORCH=1 tries it anyway" in last
    # Allowed: the next rule speaks (this build is for another torch).
    last = _import_with_torch_version(
        user_env, "2.99.0", env={"TORCH_RPC_EXT_ALLOW_UNTESTED_TORCH": "1"})
    assert last.startswith("ImportError: torch_rpc_ext was built against torch "), last


OTHER_TORCH_SITE = os.environ.get("TORCH_RPC_EXT_OTHER_TORCH_SITE")


@pytest.mark.skipif(
    not OTHER_TORCH_SITE,
    reason="needs a site-packages with another torch in TORCH_RPC_EXT_OTHER_TORCH_SITE "
    "(tools/test.sh sets it for the newest torch's stage: the default .venv's)",
)
def test_the_wheel_beside_a_real_other_torch_fails_at_import_naming_both(tmp_path, wheel):
    # A fresh venv whose torch is another release, really installed (the
    # default .venv's); the wheel goes in without its pinned requirement.
    python, _, env = _borrowing_venv(tmp_path, Path(OTHER_TORCH_SITE))
    other = _run([python, "-c", "import torch; print(torch.__version__)"],
                 cwd=tmp_path, env=env).stdout.strip()
    assert other != torch.__version__, "the other site-packages has this very torch"
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel],
         cwd=tmp_path, env=env)
    out = _run([python, "-c", "import torch_rpc_ext"], cwd=tmp_path, env=env, ok=False,
               timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: torch_rpc_ext was built against torch "
                           f"{torch.__version__}, but torch {other} is running"), last


def test_launcher_refuses_when_its_hook_is_not_in_place(user_env, tmp_path):
    # A python that ignores PYTHONPATH (-E) cannot load the hook in the
    # processes the program starts: the launch fails before running it.
    program = tmp_path / "never.py"
    program.write_text("print('ran')\n")
    out = _run([user_env["python"], "-E", "-m", "torch_rpc_ext.run", program],
               cwd=user_env["cwd"], env=user_env["env"], ok=False, timeout=120)
    assert out.returncode == 2
    assert "ran" not in out.stdout
    assert "ignores PYTHONPATH" in out.stderr and "nothing was launched" in out.stderr, out.stderr
    # The hook removed from the install: named, nothing launched.
    hook = user_env["site"] / HOOK
    saved = hook.read_bytes()
    hook.unlink()
    try:
        out = _run([user_env["python"], "-m", "torch_rpc_ext.run", program],
                   cwd=user_env["cwd"], env=user_env["env"], ok=False, timeout=120)
    finally:
        hook.write_bytes(saved)
    assert out.returncode == 2 and "ran" not in out.stdout
    assert f"{hook} is missing" in out.stderr, out.stderr


def _included(path: Path) -> set[str]:
    return set(re.findall(r'^#include "([^"]+)"', path.read_text(), re.MULTILINE))


def test_the_sdist_holds_everything_the_build_reads(tmp_path):
    _run([sys.executable, "setup.py", "-q", "sdist", "-d", tmp_path], cwd=ROOT, timeout=300)
    (archive,) = tmp_path.glob("torch_rpc_ext-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    sources = [p.relative_to(ROOT).as_posix()
               for p in [*ROOT.glob("csrc/**/*.cpp"), *ROOT.glob("scripting/*.cpp")]]
    assert sources and set(sources) <= names
    needed = {inc for s in sources for inc in _included(ROOT / s)}
    headers = [p for p in ROOT.glob("csrc/**/*.h")] + list(ROOT.glob("scripting/*.h"))
    needed |= {inc for h in headers for inc in _included(h)}
    ours = {n for n in needed if n.startswith(("csrc/", "scripting/"))}
    assert ours and ours <= names, sorted(ours - names)
    # setup.py loads the cuda.h finder by path, before the package exists.
    assert {"setup.py", "pyproject.toml", HOOK, "torch_rpc_ext/_cuda/headers.py"} <= names
    assert "torch_rpc_ext/_build_info.py" not in names  # written by the build that installs it
