# SPDX-License-Identifier: BSD-3-Clause
"""tools/sync_tree.py, which mirrors the checkout into another torch's tree
(tools/with_torch.sh) for ninja to rebuild what changed there."""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import sync_tree  # noqa: E402


def test_a_changed_source_is_newer_than_what_the_copy_built_from_it(tmp_path):
    """A source edited in the checkout before the other tree's last build
    (its objects newer than the edit) must still be rebuilt there: the copy
    takes the time of the sync, not the source's. Before, copy2 kept the
    source's time, ninja saw objects newer than it, and the other torch's
    tests ran the old code (found when a torch 2.11 run reported messages
    this checkout no longer had)."""
    root, dest = tmp_path / "root", tmp_path / "root" / "build" / "torch-x"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("build/\n")
    source = root / "a.cpp"
    source.write_text("int a = 1;\n")
    assert sync_tree.sync(str(root), str(dest)) == (2, 0)
    copy = dest / "a.cpp"
    # The other tree builds (its object is newer than everything so far).
    built = time.time() + 5
    # Edited in the checkout, at a time before that build.
    source.write_text("int a = 2;\n")
    os.utime(source, (built - 3600, built - 3600))
    before = time.time()
    assert sync_tree.sync(str(root), str(dest)) == (1, 0)
    assert copy.read_text() == "int a = 2;\n"
    assert copy.stat().st_mtime >= before - 1, (copy.stat().st_mtime, before)
    # Unchanged bytes: left alone, time and all.
    kept = copy.stat().st_mtime_ns
    assert sync_tree.sync(str(root), str(dest)) == (0, 0)
    assert copy.stat().st_mtime_ns == kept
