# SPDX-License-Identifier: BSD-3-Clause
"""The torch releases this torch_rpc_ext is tested with: one place for
setup.py (which loads this file by path, before torch_rpc_ext exists), the
import check (torch_rpc_ext._torch_version), the README and the docs
(docs/development.md, "Other torch versions"). No imports: setup.py reads it
where torch may be missing.
"""

__all__ = ["ALLOW_ENV", "REQUIREMENT", "TESTED", "in_range", "minor", "range_text"]

# [OLDEST, BELOW) by major.minor.
OLDEST = (2, 11)
BELOW = (2, 16)
REQUIREMENT = f"torch>={OLDEST[0]}.{OLDEST[1]},<{BELOW[0]}.{BELOW[1]}"
# What each release in the range was shown to do.
TESTED = {
    "2.11": "builds (compiled against its headers); CUDA path built on 2.11.0+cu130",
    "2.12": "builds (compiled against its headers)",
    "2.13.0": "the whole suite, in CI (2.13.0+cpu: the fake-CUDA tests need a CPU build)",
    "2.14.1": "builds; upstream's conformance suites and our multi-process tests pass",
    "2.15.0": "upstream's conformance suites over shm and TCP and our "
    "multi-process tests, in CI (2.15.0+cu132, on the CPU)",
}
# Set to 1 to build or import with a torch outside the range anyway (to try
# a new release; expect to fix what it changed).
ALLOW_ENV = "TORCH_RPC_EXT_ALLOW_UNTESTED_TORCH"


def minor(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.15.0+cu132", "2.16.0a0")."""
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def in_range(version: str) -> bool:
    return OLDEST <= minor(version) < BELOW


def range_text() -> str:
    return f"{REQUIREMENT} (tested: {', '.join(k for k in TESTED)})"
