# SPDX-License-Identifier: BSD-3-Clause
"""The fuzz_stream and fuzz_frame_ring targets list the sources they
compile by hand (STREAM_SOURCES in tests/fuzz/build.sh), and a new source
the stream core or a channel calls left out of it fails only the fuzzers'
build, the last stage of a run (sessions 57 and 75). Here every source of
the folders those targets draw from is either in the list or named below as
one they do not link."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDERS = ("csrc/channel/", "csrc/common/", "csrc/frame/", "csrc/transport/stream/",
           "csrc/transport/shm/")
# Listeners, transports and their factory open sockets and threads the
# harness replaces (it feeds a connection's bytes through feedForTesting);
# the thread pool is the agent's.
NOT_LINKED = {
    "csrc/common/thread_pool.cpp",
    "csrc/transport/shm/factory.cpp",
    "csrc/transport/shm/listener.cpp",
    "csrc/transport/shm/transport.cpp",
    "csrc/transport/stream/listener.cpp",
    "csrc/transport/stream/transport.cpp",
}


def stream_target_sources() -> set[str]:
    text = (ROOT / "tests/fuzz/build.sh").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("STREAM_SOURCES=")]
    return set(line.split("=", 1)[1].strip('"').split())


def test_every_source_the_stream_fuzzer_may_need_is_listed_or_named_unlinked():
    listed = stream_target_sources()
    files = subprocess.run(["git", "ls-files", "csrc/*.cpp"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    if not files:  # (not a git checkout: an sdist, a wheel's tree)
        files = [str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp")]
    candidates = {f for f in files if f.startswith(FOLDERS)}
    assert candidates, "no sources found"
    missing = sorted(candidates - listed - NOT_LINKED)
    assert not missing, (
        f"add {missing} to STREAM_SOURCES in tests/fuzz/build.sh (or, if "
        "fuzz_stream does not link them, to NOT_LINKED here)")
    assert not (listed & NOT_LINKED), listed & NOT_LINKED
    gone = sorted(f for f in listed | NOT_LINKED if not (ROOT / f).exists())
    assert not gone, gone
