# SPDX-License-Identifier: BSD-3-Clause
"""Mirror this checkout's sources (tracked files and untracked ones git does
not ignore, as they are on disk) into DEST, for a build and test run against
another torch (tools/with_torch.sh).

A C++ extension is built for one torch, and its module lands in the package
folder under a name that does not say which; so another torch gets a copy of
the tree with its own .venv, build/ and in-place module. Files whose bytes
are unchanged are left alone (their times too: ninja recompiles only what
changed), files that left the checkout leave the copy, and what the copy
made itself (ignored files: .venv, build/, the module) stays. A file copied
gets the time of the copy, not its source's: a source edited before the
copy's last build (its objects newer than the edit) would otherwise look
built already, and ninja would test the old code against that torch.

    python3 tools/sync_tree.py build/torch-2.15.0
"""

import filecmp
import os
import shutil
import subprocess
import sys

MANIFEST = ".synced-files"


def sources(root: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, check=True, capture_output=True,
    ).stdout.decode()
    # --cached lists files deleted from the work tree too.
    return sorted(f for f in out.split("\0") if f and os.path.isfile(os.path.join(root, f)))


def sync(root: str, dest: str) -> tuple[int, int]:
    """Copy what changed, remove what left; returns (copied, removed)."""
    os.makedirs(dest, exist_ok=True)
    files = sources(root)
    copied = removed = 0
    for rel in files:
        src, dst = os.path.join(root, rel), os.path.join(dest, rel)
        if os.path.isfile(dst) and filecmp.cmp(src, dst, shallow=False):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(src, dst)  # (its bytes and mode; the time is now's)
        copied += 1
    manifest = os.path.join(dest, MANIFEST)
    if os.path.exists(manifest):
        with open(manifest) as f:
            before = set(f.read().split("\0")) - {""}
        for rel in sorted(before - set(files)):
            path = os.path.join(dest, rel)
            if os.path.isfile(path):
                os.remove(path)
                removed += 1
    with open(manifest, "w") as f:
        f.write("\0".join(files))
    return copied, removed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 tools/sync_tree.py DEST")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dest = os.path.abspath(sys.argv[1])
    if dest == root or not dest.startswith(os.path.join(root, "build") + os.sep):
        sys.exit(f"sync_tree: DEST must be a folder under {root}/build, not {dest}")
    copied, removed = sync(root, dest)
    print(f"sync_tree: {dest}: {copied} file(s) copied, {removed} removed")
