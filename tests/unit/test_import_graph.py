"""No import cycles between our modules, function-level imports included (a lazy import hides a cycle from
Python, not from a reader: each module of a cycle needs the other's internals).

The graph is read from the source (ast), so it sees every import, run or not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"megatron_hpc": REPO / "megatron_hpc", "megatron_hpc.launch": REPO / "launch",
         "megatron_hpc.compile_cache": REPO / "compile_cache"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (`from a import b` counts a.b when b is a module, else a)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in targets if t in modules] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    # cli/ckpt_cmd.py imports checkpoint.tools inside a function only
    assert "megatron_hpc.checkpoint.tools" in graph["megatron_hpc.cli.ckpt_cmd"]
    assert "megatron_hpc.data.jsonl" in graph["megatron_hpc.data.tokenizer"]


@pytest.mark.parametrize("package", ["megatron_hpc.data", "megatron_hpc.checkpoint", "megatron_hpc.cli",
                                     "megatron_hpc.config", "megatron_hpc.plan", "megatron_hpc.parallel",
                                     "megatron_hpc.model", "megatron_hpc.launch", "megatron_hpc.compile_cache",
                                     "megatron_hpc.train"])
def test_no_import_cycle_touches_the_package(package):
    touching = [c for c in cycles(import_graph()) if any(m.startswith(package + ".") for m in c)]
    assert touching == []
