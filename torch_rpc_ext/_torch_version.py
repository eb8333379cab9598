# SPDX-License-Identifier: BSD-3-Clause
"""The torch this build of torch_rpc_ext is for, checked before its C++ core
loads: a C++ extension runs only with the torch it was compiled against, and
another torch would otherwise surface as an undefined-symbol traceback; and
the torch releases it is tested with (_torch_range), so a newer torch gets a
message naming them rather than a failure deep in the agent."""

import os

import torch

from torch_rpc_ext._torch_range import ALLOW_ENV, in_range, range_text

__all__ = ["built_for", "check_torch", "load_error"]

_REBUILD = (
    "rebuild torch_rpc_ext against the torch you run: from its source, "
    "`pip install --no-build-isolation --force-reinstall --no-deps .`"
)


def built_for() -> str | None:
    """The torch version this build was compiled against (setup.py writes
    ``_build_info.py``), or None for a tree built before it did."""
    try:
        from torch_rpc_ext._build_info import TORCH_VERSION
    except ImportError:
        return None
    return TORCH_VERSION


def check_torch() -> None:
    """Raise ImportError if the running torch is outside the tested range
    (unless TORCH_RPC_EXT_ALLOW_UNTESTED_TORCH=1), or is not the one this
    build was compiled against, naming both versions. The second rule is
    strict, version and local tag alike (2.13.0+cpu is not 2.13.0+cu130):
    the two are other binaries."""
    want, have = built_for(), str(torch.__version__)
    if not in_range(have) and os.environ.get(ALLOW_ENV) != "1":
        built = f" (this build is for torch {want})" if want else ""
        raise ImportError(
            f"torch_rpc_ext {_package_version()} is tested with {range_text()}, "
            f"and torch {have} is running{built}. Install a torch in that range, "
            f"or a torch_rpc_ext release that supports torch {have}; "
            f"{ALLOW_ENV}=1 tries it anyway"
        )
    if want is not None and want != have:
        raise ImportError(
            f"torch_rpc_ext was built against torch {want}, but torch {have} is "
            f"running; {_REBUILD}"
        )


def load_error(e: ImportError) -> ImportError:
    """The core failed to load although the versions match (a torch of the
    same version but another build): the same advice, with the loader's text."""
    return ImportError(
        f"torch_rpc_ext's C++ core does not load with torch {torch.__version__} "
        f"(built against {built_for() or 'an unrecorded torch'}): {e}; {_REBUILD}"
    )


def _package_version() -> str:
    from torch_rpc_ext import __version__

    return __version__
