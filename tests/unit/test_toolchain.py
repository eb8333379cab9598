# SPDX-License-Identifier: BSD-3-Clause
"""setup.py's toolchain probe (torch_rpc_ext/_toolchain.py): a compiler that
links a copy of libstdc++ into shared libraries gets the link flags that keep
that copy from splitting iostreams in two (the 2026-11-26 H200 machine's g++
did: number writing crashed every member of a dynamic group there).

The faulty compilers are made here as wrappers of the machine's g++: one
that passes -static-libstdc++, one that puts a folder holding only
libstdc++.a first on the library path (as the H200's /opt/gcc did)."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

import torch_rpc_ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CXX = shutil.which("g++")

pytestmark = pytest.mark.skipif(
    CXX is None or shutil.which("nm") is None or shutil.which("readelf") is None,
    reason="needs g++, nm and readelf (binutils)",
)


def load_toolchain():
    spec = importlib.util.spec_from_file_location(
        "_toolchain_under_test", os.path.join(ROOT, "torch_rpc_ext", "_toolchain.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


toolchain = load_toolchain()


def static_archive() -> str | None:
    found = subprocess.run([CXX, "-print-file-name=libstdc++.a"],
                           capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def wrapper(tmp_path, kind: str) -> str:
    """A g++ that links libstdc++ statically into shared libraries."""
    path = tmp_path / f"g++-{kind}"
    if kind == "flag":
        body = f'exec {CXX} "$@" -static-libstdc++\n'
    else:
        archive = static_archive()
        if archive is None:
            pytest.skip("this g++ has no libstdc++.a")
        folder = tmp_path / "archive-only"
        folder.mkdir()
        (folder / "libstdc++.a").symlink_to(archive)
        body = f'exec {CXX} -B{folder}/ "$@"\n'
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


WRITER = r"""
#include <sstream>
#include <string>
extern "C" int write_number(char* out, int size) {
  std::ostringstream text;
  text << 17L << ' ' << 2.5;
  std::string s = text.str();
  int n = static_cast<int>(s.size()) < size - 1 ? static_cast<int>(s.size()) : size - 1;
  s.copy(out, n);
  out[n] = 0;
  return n;
}
"""


def written_after_torch(library: str) -> subprocess.CompletedProcess:
    """What LIBRARY writes for 17 and 2.5, loaded into a process that has
    torch (and so the system's libstdc++) loaded first."""
    code = (
        "import ctypes, torch\n"
        f"lib = ctypes.CDLL({library!r})\n"
        "out = ctypes.create_string_buffer(64)\n"
        "lib.write_number(out, 64)\n"
        "print(out.value.decode())\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def link_writer(linker: list[str], flags: list[str], tmp_path, name: str) -> str:
    source = tmp_path / "writer.cpp"
    source.write_text(WRITER)
    output = str(tmp_path / f"{name}.so")
    subprocess.run([*linker, "-fPIC", "-O2", str(source), "-o", output, *flags],
                   check=True, capture_output=True, timeout=120)
    return output


def test_a_stock_compiler_is_left_as_it_is():
    flags, what = toolchain.libstdcxx_link_args([CXX, "-shared", "-Wl,-Bsymbolic-functions"])
    assert (flags, what) == ([], "")


@pytest.mark.not_sanitized("its library must crash, and the preloaded libstdc++ (tools/sanitizer_env.sh) mends it")
@pytest.mark.parametrize("kind", ["flag", "archive-only"])
def test_a_compiler_that_copies_libstdcxx_in_gets_a_remedy_that_works(tmp_path, kind):
    linker = [wrapper(tmp_path, kind), "-shared", "-Wl,-Bsymbolic-functions"]
    # The fault is real: its library exports stream code and, loaded after
    # torch, writes its numbers wrong (empty here; a crash on the H200).
    faulty = link_writer(linker, [], tmp_path, "faulty")
    assert toolchain.exports_stream_code(faulty)
    broken = written_after_torch(faulty)
    assert broken.returncode != 0 or broken.stdout.strip() != "17 2.5", broken

    flags, what = toolchain.libstdcxx_link_args(linker)
    assert flags in [remedy for _, remedy in toolchain.REMEDIES], (flags, what)
    assert "links a copy of libstdc++" in what and " ".join(flags) in what
    cured = link_writer(linker, flags, tmp_path, "cured")
    assert not toolchain.exports_stream_code(cured)
    done = written_after_torch(cured)
    assert done.returncode == 0 and done.stdout.strip() == "17 2.5", done


def test_no_working_remedy_is_a_warning_naming_what_was_tried(tmp_path, monkeypatch):
    linker = [wrapper(tmp_path, "flag"), "-shared"]
    monkeypatch.setattr(toolchain, "REMEDIES", (("nothing", ["-Wl,-O1"]),))
    flags, what = toolchain.libstdcxx_link_args(linker)
    assert flags == []
    assert what.startswith("warning:") and "-Wl,-O1" in what and "shared library" in what


def test_a_linker_that_cannot_link_leaves_the_build_to_say_so(tmp_path):
    assert toolchain.libstdcxx_link_args([str(tmp_path / "no-such-g++"), "-shared"]) == ([], "")


def test_the_built_extension_carries_no_libstdcxx_of_its_own():
    (core,) = [os.path.join(os.path.dirname(torch_rpc_ext.__file__), f)
               for f in os.listdir(os.path.dirname(torch_rpc_ext.__file__))
               if f.startswith("_C.") and f.endswith(".so")]
    assert not toolchain.exports_stream_code(core)
