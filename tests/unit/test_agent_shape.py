# SPDX-License-Identifier: BSD-3-Clause
"""csrc/agent reads as a facade and a few nouns (docs/architecture.md, "The
agent"): each part a class with a header of its own that says what it owns
and which threads call it, no class implemented across more than three
files, no file over 600 lines, no include cycle; and the Python package's
modules do not import each other in a circle."""

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "csrc" / "agent"
PACKAGE = ROOT / "torch_rpc_ext"
INCLUDE = re.compile(r'^\s*#\s*include\s+"csrc/agent/([^"]+)"', re.M)
# A member function defined at namespace scope: "Type Class::name(" at the
# start of a line (the return type may span the line before); not a call
# of a static member, indented in a body.
DEFINITION = re.compile(r"^(?:[\w:<>,*&][\w:<>,*& ]*\s)?([A-Z]\w*)::~?\w+\(", re.M)
PARTS = (
    "agent.h",
    "group.h",
    "connections.h",
    "calls.h",
    "server.h",
    "rref_guard.h",
    "devices.h",
    "call_table.h",
)


def include_graph() -> dict[str, set[str]]:
    return {p.name: set(INCLUDE.findall(p.read_text())) for p in sorted(AGENT.iterdir())}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a.h": {"b.h"}, "b.h": {"c.h"}, "c.h": {"a.h"}}) == ["a.h", "b.h", "c.h", "a.h"]
    assert find_cycle({"a.h": {"b.h"}, "b.h": set()}) is None


def test_the_agents_include_graph_has_no_cycle():
    assert find_cycle(include_graph()) is None


@pytest.mark.parametrize("path", sorted(AGENT.iterdir()), ids=lambda p: p.name)
def test_no_agent_file_is_over_600_lines(path):
    assert len(path.read_text().splitlines()) <= 600


def test_no_class_is_implemented_across_more_than_three_files():
    files = defaultdict(set)
    for path in AGENT.glob("*.cpp"):
        for cls in DEFINITION.findall(path.read_text()):
            files[cls].add(path.name)
    assert {"Agent", "Group", "Connections", "Calls", "Server", "RRefGuard", "AgentDevices"} <= set(files)
    spread = {cls: sorted(names) for cls, names in files.items() if len(names) > 3}
    assert not spread


@pytest.mark.parametrize("header", PARTS)
def test_each_part_says_which_threads_call_it(header):
    text = (AGENT / header).read_text()
    assert re.search(r"^// Threads", text, re.M), f"{header} has no thread contract"


def test_the_facade_holds_its_parts_and_not_their_state():
    text = (AGENT / "agent.h").read_text()
    for part in (
        "Group group_;",
        "Connections connections_;",
        "Calls calls_;",
        "Server server_;",
        "RRefGuard rrefs_;",
        "AgentDevices devices_;",
    ):
        assert part in text
    # What the parts own is not the agent's.
    for field in (
        "outbound_",
        "roster_",
        "leases_",
        "forkHolders_",
        "transports_",
        "view_",
        "cudaLanded",
        "completions_",
        "clientActiveCalls_",
        "serverActiveCalls_",
    ):
        assert field not in text, field


def package_imports() -> dict[str, set[str]]:
    """torch_rpc_ext's modules and the modules of ours each imports, at any
    depth in the module (a function-level import closes a cycle too)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "torch_rpc_ext":
                    deps |= {a.name for a in node.names if a.name in modules}
                elif node.module.startswith("torch_rpc_ext."):
                    deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("torch_rpc_ext."):
                        deps.add(a.name.split(".")[1])
        graph[path.stem] = deps & modules - {path.stem}
    return graph


def test_the_python_modules_do_not_import_each_other_in_a_circle():
    graph = package_imports()
    assert "elastic" in graph["backend"]
    assert find_cycle(graph) is None


def test_the_agent_does_not_branch_on_the_kind_of_group():
    """A static and a dynamic group differ inside Group (and the parts it
    configures), not in the facade: only join()'s protocol differs there (a
    barrier, or leaving alone)."""
    text = "".join((AGENT / f).read_text() for f in ("agent.h", "agent.cpp", "agent_send.cpp"))
    assert "worldSize_" not in text
    assert text.count("isDynamic()") == 1
    assert "worldSize_" not in (AGENT / "server.cpp").read_text()
