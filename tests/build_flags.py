# SPDX-License-Identifier: BSD-3-Clause
"""How the extension under test was built (setup.py's _build_info.py)."""


def _sanitizer():
    try:
        from torch_rpc_ext._build_info import BUILD_FLAGS
    except ImportError:  # a tree built before setup.py wrote it
        return None
    for flag in BUILD_FLAGS[0]:
        if flag.startswith("-fsanitize="):
            return flag.split("=", 1)[1]
    return None


# "address" or "thread" in a sanitized build (tools/sanitize.sh), else None.
# Memory figures mean little there: ASan keeps freed memory in quarantine
# (256 MiB by default) and TSan shadows every byte.
SANITIZER = _sanitizer()
