# SPDX-License-Identifier: BSD-3-Clause
"""Whether the build's linker puts a copy of libstdc++ into a shared library,
and the link flags that keep it out (setup.py loads this by path; it needs
neither torch nor the package).

torch and Python load the system's libstdc++.so. An extension that carries
pieces of a second libstdc++ (a compiler that links it statically, as one
GPU machine's did: ``-static-libstdc++`` in a wrapper or its specs) holds its
own copies of iostreams and of the locale's facet ids; with the usual
``-Bsymbolic-functions`` its functions bind to its copies and its data to the
system's, and a number written or read through a stream crashes or comes
out empty (docs/cuda.md, "Toolchains"). The cure, tried in order and each
proven on a probe library linked by the same command as the extension:

* ``-nostdlib++ -lstdc++ -lm``: the driver adds no libstdc++ of its own and
  the one named links as the shared library (gcc 13+, clang);
* ``-Wl,--exclude-libs,...``: the static copy stays, hidden, so that the
  extension uses one copy, its own, for functions and data alike.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

PROBE_SOURCE = r"""
#include <sstream>
#include <string>
extern "C" int torch_rpc_ext_probe(long value) {
  std::ostringstream out;
  out << value;
  return static_cast<int>(out.str().size());
}
"""

# std::ostream::_M_insert<long>: what libstdc++.so defines and a library
# linked against it only references.
STREAM_SYMBOL = "_ZNSo9_M_insertIlEERSoT_"

REMEDIES = (
    ("the shared libstdc++ named explicitly", ["-nostdlib++", "-lstdc++", "-lm"]),
    ("its static copy hidden", ["-Wl,--exclude-libs,libstdc++.a:libsupc++.a"]),
)


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def exports_stream_code(library: str) -> bool:
    """Whether LIBRARY's dynamic symbol table defines libstdc++'s stream
    writing (a copy of libstdc++ that the process's can interpose on)."""
    listing = _run(["nm", "-D", "--defined-only", library])
    return STREAM_SYMBOL in listing.stdout


def needs_shared_libstdcxx(library: str) -> bool:
    listing = _run(["readelf", "-d", library])
    return "libstdc++.so" in listing.stdout


def link_probe(linker: list[str], flags: list[str], folder: str) -> str | None:
    """The probe built by LINKER (the extension's link command, a C++
    compiler driver and its flags) with FLAGS; None if it did not link."""
    source = os.path.join(folder, "probe.cpp")
    if not os.path.exists(source):
        with open(source, "w") as f:
            f.write(PROBE_SOURCE)
    output = os.path.join(folder, f"probe{abs(hash(tuple(flags)))}.so")
    done = _run([*linker, "-fPIC", "-O1", source, "-o", output, *flags])
    return output if done.returncode == 0 and os.path.exists(output) else None


def libstdcxx_link_args(linker: list[str]) -> tuple[list[str], str]:
    """(flags, what) for an extension linked by LINKER: no flags when it
    links libstdc++ as a shared library (what = ""), else the first remedy
    that a probe proves, and what was found; a remedy of none, and a
    warning, where none works. Tools missing (nm, readelf) or a probe that
    does not link at all: no flags, and the build goes on as before."""
    try:
        with tempfile.TemporaryDirectory(prefix="torch_rpc_ext_toolchain") as folder:
            plain = link_probe(linker, [], folder)
            if plain is None or not exports_stream_code(plain):
                return [], ""
            for name, flags in REMEDIES:
                probe = link_probe(linker, flags, folder)
                if probe is None or exports_stream_code(probe):
                    continue
                if flags[0] == "-nostdlib++" and not needs_shared_libstdcxx(probe):
                    continue
                return flags, (
                    f"{linker[0]} links a copy of libstdc++ into shared libraries; "
                    f"linking torch_rpc_ext with {name} ({' '.join(flags)})"
                )
            return [], (
                f"warning: {linker[0]} links a copy of libstdc++ into shared libraries "
                "and no remedy worked (tried "
                + "; ".join(" ".join(f) for _, f in REMEDIES)
                + "): numbers written through C++ streams may crash torch_rpc_ext; "
                "build with a compiler that links libstdc++ as a shared library"
            )
    except (OSError, subprocess.SubprocessError):
        return [], ""
