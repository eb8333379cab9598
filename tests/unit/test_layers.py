# SPDX-License-Identifier: BSD-3-Clause
"""The transport and channel layers have the shape docs/architecture.md claims.

A transport is a folder of its own plus one line in the registry: the agent
and the bindings name no concrete transport and include nothing from a
transport's folder, sibling transports never include each other, and the
shared stream core knows none of them. Likewise a channel (how tensor bytes
travel): a folder of its own plus one line in channel/registry.cpp; the
agent, the bindings, the stream core and the transports include no concrete
channel, and channels include no transport (only the wire vocabulary of
csrc/frame/frame.h, which sits below both and needs nothing but the
standard library and common/).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
TRANSPORTS = ("tcp", "shm")
# Every folder under csrc/channel/ is a concrete channel (or a family of
# them): a new one is checked without editing this file.
CHANNEL_FOLDERS = tuple(sorted(p.name for p in (CSRC / "channel").iterdir() if p.is_dir()))
# The test hooks (setup.py's TESTING_SOURCES, never in a wheel) may reach
# into a transport's or channel's folder to drive its parts alone.
TEST_HOOKS = {
    ROOT / src
    for src in re.findall(
        r'"(csrc/[^"]+)"', re.search(r"TESTING_SOURCES = \[(.*?)\]", (ROOT / "setup.py").read_text(), re.S)[1]
    )
}
CHANNELS = ("shm_slab", "shm_ring", "cuda_ipc")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# A C++ string literal naming a transport: "shm", "tcp", or one starting
# with the name and a space/colon ("shm: ...").
NAMED = re.compile(r'"(?:%s)(?:"|[ :])' % "|".join(TRANSPORTS + CHANNELS))


def sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in (".h", ".cpp"))


def includes(path: Path) -> list[str]:
    return INCLUDE.findall(path.read_text())


def code_without_comments(path: Path) -> str:
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def test_the_channel_folders_are_found():
    assert {"shm", "cuda", "cuda_ipc", "cuda_ring", "cuda_self", "cuda_staged"} <= set(CHANNEL_FOLDERS)


def test_the_cuda_channels_share_the_device_layer_and_not_each_other():
    # csrc/channel/cuda is the device layer (driver, memory, copy engine,
    # staging pools) under the CUDA channels, as TensorPipe's cuda
    # helpers sit under its cuda_ipc and cuda_basic: it includes neither,
    # and none includes another.
    cuda_channels = ("cuda_ipc", "cuda_ring", "cuda_self", "cuda_staged")
    rules = {"cuda": cuda_channels,
             **{c: tuple(o for o in cuda_channels if o != c) for c in cuda_channels}}
    bad = [
        (p.relative_to(ROOT).as_posix(), inc)
        for folder, banned in rules.items()
        for p in sources(CSRC / "channel" / folder)
        for inc in includes(p)
        if any(inc.startswith(f"csrc/channel/{b}/") for b in banned)
    ]
    assert not bad, bad


def test_the_tree_has_the_layers():
    for folder in ("stream", *TRANSPORTS):
        assert (CSRC / "transport" / folder).is_dir(), folder
    for backend in TRANSPORTS:
        names = {p.name for p in (CSRC / "transport" / backend).iterdir()}
        for base in ("factory", "transport", "listener", "connection"):
            assert {f"{base}.h", f"{base}.cpp"} <= names, (backend, base)


def test_the_test_hooks_are_found():
    assert CSRC / "bindings" / "bind_testing_cuda.cpp" in TEST_HOOKS
    assert all(p.is_file() for p in TEST_HOOKS)


@pytest.mark.parametrize("layer", [CSRC / "agent", CSRC / "bindings", ROOT / "scripting"])
def test_agent_bindings_and_scripting_use_only_the_seams(layer):
    # transport/*.h and channel/*.h, never a folder below them (the stream
    # core included); only the test hooks may.
    bad = [
        (p.relative_to(ROOT).as_posix(), inc)
        for p in sources(layer)
        if p not in TEST_HOOKS
        for inc in includes(p)
        if re.match(r"csrc/(transport|channel)/[^/]+/", inc)
    ]
    assert not bad, bad


def test_siblings_and_the_stream_core_do_not_include_each_other():
    bad = []
    for folder in ("stream", *TRANSPORTS):
        others = [t for t in TRANSPORTS if t != folder]
        for p in sources(CSRC / "transport" / folder):
            for inc in includes(p):
                if any(inc.startswith(f"csrc/transport/{o}/") for o in others):
                    bad.append((p.relative_to(ROOT).as_posix(), inc))
    assert not bad, bad


def test_only_the_registries_name_transports_and_channels_outside_their_folders():
    backend_dirs = [CSRC / "transport" / t for t in TRANSPORTS]
    backend_dirs += [CSRC / "channel" / c for c in CHANNEL_FOLDERS]
    registries = {CSRC / "transport" / "registry.cpp", CSRC / "channel" / "registry.cpp"}
    bad = []
    for p in sources(CSRC):
        if p in registries or any(d in p.parents for d in backend_dirs):
            continue
        for line in code_without_comments(p).splitlines():
            if NAMED.search(line):
                bad.append((p.relative_to(ROOT).as_posix(), line.strip()))
    assert not bad, bad


def test_the_check_would_catch_a_named_transport(tmp_path):
    # The patterns above must match what they are meant to forbid.
    probe = tmp_path / "probe.cpp"
    probe.write_text('#include "csrc/transport/tcp/address.h"\nif (n == "shm") {}\n')
    assert includes(probe) == ["csrc/transport/tcp/address.h"]
    assert NAMED.search(code_without_comments(probe))
    assert NAMED.search('x = "shm_slab";')


def test_channels_are_a_seam_of_their_own():
    assert (CSRC / "channel" / "channel.h").is_file()
    concrete = tuple(f"csrc/channel/{c}/" for c in CHANNEL_FOLDERS)
    bad = []
    # Nothing but the channel registry (and a channel's own folder) includes
    # a concrete channel...
    for p in sources(CSRC):
        if p in TEST_HOOKS:
            continue
        if p == CSRC / "channel" / "registry.cpp" or (CSRC / "channel") in p.parents and any(
            (CSRC / "channel" / c) in p.parents for c in CHANNEL_FOLDERS
        ):
            continue
        bad += [(p.relative_to(ROOT).as_posix(), inc) for inc in includes(p) if inc.startswith(concrete)]
    # ...and channels know no transport: only the frame vocabulary, which
    # lives below both.
    for p in sources(CSRC / "channel"):
        bad += [
            (p.relative_to(ROOT).as_posix(), inc)
            for inc in includes(p)
            if inc.startswith("csrc/transport/")
        ]
    assert not bad, bad


def test_the_frame_vocabulary_sits_below_transports_and_channels():
    bad = [
        (p.relative_to(ROOT).as_posix(), inc)
        for p in sources(CSRC / "frame")
        for inc in includes(p)
        if not inc.startswith(("csrc/frame/", "csrc/common/"))
    ]
    assert not bad, bad
    text = "\n".join(p.read_text() for p in sources(CSRC / "frame"))
    assert not re.search(r"#\s*include\s*<(torch|c10|ATen|pybind11)", text)


def test_rings_and_slabs_live_in_the_shm_channels_only():
    pattern = re.compile(r"\b(Ring|Slab)(Record|Counters)?\b|\b(ring|slab)s?_")
    bad = []
    for p in sources(CSRC):
        if (CSRC / "channel" / "shm") in p.parents:
            continue
        for line in code_without_comments(p).splitlines():
            # Using the shm layer's types (cuda_ring's memfd) is allowed.
            if pattern.search(re.sub(r"\bshm::\w+", "", line)):
                bad.append((p.relative_to(ROOT).as_posix(), line.strip()))
    assert not bad, bad


def test_scripting_sits_above_the_agent():
    # scripting/ may use the agent and torch, never pybind11 or the bindings;
    # below the bindings nothing includes scripting/ (the agent serves named
    # functions through csrc/agent/named_functions.h, which the scripting
    # layer installs).
    scripting = ROOT / "scripting"
    bad = []
    for p in sources(scripting):
        for inc in includes(p):
            if inc.startswith("csrc/bindings/") or "pybind" in inc:
                bad.append((p.relative_to(ROOT).as_posix(), inc))
        text = p.read_text()
        if re.search(r"#\s*include\s*<(pybind11|torch/csrc/utils/pybind|torch/csrc/jit/python)", text):
            bad.append((p.relative_to(ROOT).as_posix(), "a Python header"))
    for p in sources(CSRC):
        if (CSRC / "bindings") in p.parents:
            continue
        bad += [(p.relative_to(ROOT).as_posix(), inc) for inc in includes(p) if inc.startswith("scripting/")]
    assert not bad, bad
