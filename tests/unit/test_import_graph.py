"""Our import graph, read from the source (ast) so that it sees every import, run or not, function-level ones
included: no cycles between our modules, and every arrow points down the layer table below.

A lazy import hides a cycle or an upward arrow from Python, not from a reader: each side still needs the other's
internals. The table is STYLE.md section 1's, with rows for the packages and top-level modules it does not list.
A package may import itself and the packages of its row, nothing else of ours (a module path handed to
`python -m` or importlib is not an import). checkpoint/ counts as one package here; its three rooms and
their one-way order are tests/unit/test_checkpoint_rooms.py's.

    package         may import
    errors          (nothing: the leaf)
    megatron_hpc    (nothing: the root __init__, __version__ only)
    atomic_write    errors
    config          errors
    plan            config, errors
    run_folder      plan, config, atomic_write, errors
    run_markers     run_folder, plan, config, atomic_write, errors
    debug_stacks    run_folder, plan, config, atomic_write, errors
    heartbeat       run_folder, plan, config, atomic_write, errors
    warm_protocol   (nothing: paths and messages the warm process and its client share)
    warm_server     warm_protocol
    compile_cache   plan, config, atomic_write, errors
    launch          compile_cache, checkpoint, run_markers, debug_stacks, heartbeat, warm_protocol, run_folder, plan,
                    config, atomic_write, errors, megatron_hpc
    parallel        plan, config, errors
    model           parallel, plan, config, errors
    data            parallel, plan, config, errors
    checkpoint      data, parallel, plan, config, atomic_write, errors
    generate        checkpoint, model, data, parallel, plan, config, errors
    evaluate        generate, checkpoint, model, data, parallel, plan, config, errors
    train           evaluate, generate, checkpoint, model, data, parallel, compile_cache, run_markers, debug_stacks,
                    heartbeat, run_folder, plan, config, atomic_write, errors, megatron_hpc
    cli             (every package above; train and the torch ones only inside its functions)
    __main__        cli

`warm_server` imports torch and the trainer by name at run time (what it preloads before forking workers).
`launch` may import `checkpoint` only for its pure path functions (run status reads the checkpoint tracker); that
the launcher never reaches torch, parent `__init__`s included, is held by a test of its own below.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"megatron_hpc": REPO / "megatron_hpc", "megatron_hpc.launch": REPO / "launch",
         "megatron_hpc.compile_cache": REPO / "compile_cache"}


@functools.cache
def _modules() -> dict[str, Path]:
    found = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


@functools.cache
def _lazy_faces() -> dict[str, dict[str, str]]:
    """package -> {name: the module that defines it} for each package `__init__` that imports its names on first
    use (checkpoint/store: an `_EXPORTS` dict, module -> names), so that the graph follows a name to its module."""
    faces = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["_EXPORTS"]:
                faces[name] = {n: f"{name}.{m}" for m, names in ast.literal_eval(node.value).items() for n in names}
    return faces


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (`from a import b` counts a.b when b is a module, or the module a
    lazy face loads for b, else a).

    Read once per session (cached): callers must not change it."""
    modules, lazy = _modules(), _lazy_faces()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
                targets += [lazy[node.module][a.name] for a in node.names if a.name in lazy.get(node.module, {})]
                targets = [t for t in targets if t in modules] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def _row(names: str) -> frozenset[str]:
    return frozenset(names.split())


MAY_IMPORT: dict[str, frozenset[str]] = {
    "errors": _row(""),
    "megatron_hpc": _row(""),
    "atomic_write": _row("errors"),
    "config": _row("errors"),
    "plan": _row("config errors"),
    "run_folder": _row("plan config atomic_write errors"),
    "run_markers": _row("run_folder plan config atomic_write errors"),
    "debug_stacks": _row("run_folder plan config atomic_write errors"),
    "heartbeat": _row("run_folder plan config atomic_write errors"),
    "warm_protocol": _row(""),
    "warm_server": _row("warm_protocol"),
    "compile_cache": _row("plan config atomic_write errors"),
    "launch": _row("compile_cache checkpoint run_markers debug_stacks heartbeat warm_protocol run_folder plan config "
                   "atomic_write errors megatron_hpc"),
    "parallel": _row("plan config errors"),
    "model": _row("parallel plan config errors"),
    "data": _row("parallel plan config errors"),
    "checkpoint": _row("data parallel plan config atomic_write errors"),
    "generate": _row("checkpoint model data parallel plan config errors"),
    "evaluate": _row("generate checkpoint model data parallel plan config errors"),
    "train": _row("evaluate generate checkpoint model data parallel compile_cache run_markers debug_stacks heartbeat "
                  "run_folder plan config atomic_write errors megatron_hpc"),
    "__main__": _row("cli"),
}
"""The layer table of the module docstring: package -> the packages of ours it may import besides itself."""
MAY_IMPORT["cli"] = frozenset(MAY_IMPORT) - {"__main__"}
TORCH_PACKAGES = ("train", "model", "parallel", "generate", "evaluate", "checkpoint")
"""Packages built on torch: the CLI imports them only inside functions, so that --help and plan start without it."""


def package_of(module: str) -> str:
    """The table's name for a module's package: `megatron_hpc.train.step` -> train, the root -> megatron_hpc."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_arrows(graph: dict[str, set[str]], may_import: dict[str, frozenset[str]]) -> list[str]:
    """Every import between two of our packages that the table does not allow, one line each."""
    found = []
    for module in sorted(graph):
        layer = package_of(module)
        for dep in sorted(graph[module]):
            target = package_of(dep)
            if target == layer:
                continue
            if layer not in may_import:
                found.append(f"{module} -> {dep} (layer {layer} has no row in MAY_IMPORT; add one)")
            elif target not in may_import[layer]:
                found.append(f"{module} -> {dep} (layer {layer} may not import {target})")
    return found


def reachable(graph: dict[str, set[str]], starts: set[str]) -> set[str]:
    """Modules that importing `starts` may load: their imports, transitively, and every parent package's
    `__init__` (importing a.b.c runs a/__init__.py and a/b/__init__.py first)."""
    seen, todo = set(starts), list(starts)
    while todo:
        module = todo.pop()
        parts = module.split(".")
        parents = {".".join(parts[:i]) for i in range(1, len(parts))} & graph.keys()
        for dep in (graph[module] | parents) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def _top_level_imports(path: Path) -> set[str]:
    """Modules named by the import statements that run when the module is imported: all but those inside
    functions (a class body runs at import)."""
    names: set[str] = set()
    pending: list[ast.AST] = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            pending.extend(ast.iter_child_nodes(node))
    return names


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
    # cli/ckpt_cmd.py imports the checkpoint.conversion face inside a function only
    assert "megatron_hpc.checkpoint.conversion" in graph["megatron_hpc.cli.ckpt_cmd"]
    assert "megatron_hpc.data.jsonl" in graph["megatron_hpc.data.tokenizer"]


@pytest.mark.parametrize("package", ["megatron_hpc.data", "megatron_hpc.checkpoint", "megatron_hpc.cli",
                                     "megatron_hpc.config", "megatron_hpc.plan", "megatron_hpc.parallel",
                                     "megatron_hpc.model", "megatron_hpc.launch", "megatron_hpc.compile_cache",
                                     "megatron_hpc.train", "megatron_hpc.generate", "megatron_hpc.evaluate"])
def test_no_import_cycle_touches_the_package(package):
    touching = [c for c in cycles(import_graph()) if any(m.startswith(package + ".") for m in c)]
    assert touching == []


def test_the_arrow_check_lists_every_upward_arrow():
    table = {"low": frozenset(), "high": frozenset({"low"})}
    graph = {"megatron_hpc.low.a": {"megatron_hpc.high.b", "megatron_hpc.low.c"},
             "megatron_hpc.low.c": set(),
             "megatron_hpc.high.b": {"megatron_hpc.low.a"},
             "megatron_hpc.side.d": {"megatron_hpc.low.c"}}
    assert upward_arrows(graph, table) == [
        "megatron_hpc.low.a -> megatron_hpc.high.b (layer low may not import high)",
        "megatron_hpc.side.d -> megatron_hpc.low.c (layer side has no row in MAY_IMPORT; add one)",
    ]
    assert upward_arrows({"megatron_hpc.high.b": {"megatron_hpc.low.a"}, "megatron_hpc.low.a": set()}, table) == []


def test_every_arrow_points_down_the_layer_table():
    arrows = upward_arrows(import_graph(), MAY_IMPORT)
    assert not arrows, "imports against the layer table (tests/unit/test_import_graph.py):\n" + "\n".join(arrows)


def test_the_layer_table_is_layered_and_covers_every_package():
    assert cycles({layer: set(may) for layer, may in MAY_IMPORT.items()}) == []
    assert all(layer not in may for layer, may in MAY_IMPORT.items())
    assert {t for may in MAY_IMPORT.values() for t in may} <= MAY_IMPORT.keys()
    assert {package_of(m) for m in import_graph()} == MAY_IMPORT.keys(), "a package without a row, or a stale row"


def test_the_docstring_table_is_the_one_tested():
    lines = __doc__.split("    package         may import\n", 1)[1].split("\n\n", 1)[0].splitlines()
    rows: dict[str, str] = {}
    last = ""
    for line in lines:
        if line.startswith("     "):  # a continuation of the row above
            rows[last] += " " + line.strip()
        else:
            last, text = line.strip().split(None, 1)
            rows[last] = text
    parsed = {layer: frozenset() if text.startswith("(nothing") else frozenset(text.replace(",", " ").split())
              for layer, text in rows.items() if layer != "cli"}
    assert parsed == {layer: may for layer, may in MAY_IMPORT.items() if layer != "cli"}
    assert rows.keys() == MAY_IMPORT.keys()


def test_the_graph_has_no_relative_imports_it_would_miss():
    relative = [f"{name}:{node.lineno}" for name, path in _modules().items()
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert relative == [], "use absolute imports (megatron_hpc....) so the import graph sees them"


def _imports_torch(path: Path) -> bool:
    """Whether any import statement of the file, function-level ones included, names torch or torch_xla."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        if any(n.split(".")[0] in ("torch", "torch_xla") for n in names):
            return True
    return False


@pytest.mark.parametrize("package", ["megatron_hpc.launch", "megatron_hpc.compile_cache"])
def test_the_launcher_never_reaches_torch(package):
    """STYLE.md 1, statically: not one module the launcher may load imports torch, even in a function (the
    runtime check of sys.modules sees only the paths a test happens to run)."""
    graph, modules = import_graph(), _modules()
    loaded = reachable(graph, {m for m in graph if m == package or m.startswith(package + ".")})
    torch_side = sorted(m for m in loaded if _imports_torch(modules[m]))
    assert torch_side == [], f"{package} reaches modules that import torch: {torch_side}"


def test_the_reach_includes_parent_packages():
    graph = {"megatron_hpc.low": {"megatron_hpc.heavy.x"}, "megatron_hpc.low.paths": set(),
             "megatron_hpc.heavy.x": set(), "megatron_hpc.launch.a": {"megatron_hpc.low.paths"}}
    assert reachable(graph, {"megatron_hpc.launch.a"}) >= {"megatron_hpc.low", "megatron_hpc.heavy.x"}


def test_the_cli_imports_torch_packages_only_inside_functions():
    modules = _modules()
    eager = sorted(f"{name} -> {dep}" for name, path in modules.items() if package_of(name) in ("cli", "__main__")
                   for dep in _top_level_imports(path) if dep.startswith("megatron_hpc.")
                   and package_of(dep) in TORCH_PACKAGES)
    assert eager == [], "import these inside the command's run(): " + ", ".join(eager)


def test_top_level_imports_skip_function_bodies(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import a\nif True:\n    import b\ndef f():\n    import c\nclass K:\n    import d\n")
    assert _top_level_imports(source) == {"a", "b", "d"}
