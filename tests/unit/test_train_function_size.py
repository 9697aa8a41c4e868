"""No function in megatron_hpc/train/ is over 60 lines (STYLE.md section 8): the trainer is read first, so it stays
readable in screenfuls. Methods and nested functions count on their own; a function's lines run from its `def` to
its last line, docstring included, decorators not."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_hpc.train

MAX_LINES = 60
TRAIN = Path(megatron_hpc.train.__file__).resolve().parent


def function_lengths(source: str, *, module: str) -> dict[str, int]:
    """'module::Class.method' (or 'module::function') -> its number of lines, for every function in `source`."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lengths[f"{module}::{name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


def test_the_measure_counts_methods_and_nested_functions_from_def_to_last_line() -> None:
    source = ("class A:\n"
              "    @property\n"
              "    def f(self):\n"
              "        def g():\n"
              "            return 1\n"
              "        return g()\n"
              "def h():\n"
              "    '''doc'''\n"
              "    x = 1\n"
              "\n"
              "    return x\n")
    assert function_lengths(source, module="m.py") == {"m.py::A.f": 4, "m.py::A.f.g": 2, "m.py::h": 5}


def test_no_function_in_train_is_over_60_lines() -> None:
    lengths: dict[str, int] = {}
    for path in sorted(TRAIN.glob("*.py")):
        lengths.update(function_lengths(path.read_text(), module=path.name))
    assert len(lengths) > 100  # the whole package was read
    offenders = sorted(((n, name) for name, n in lengths.items() if n > MAX_LINES), reverse=True)
    assert not offenders, "functions in megatron_hpc/train/ over 60 lines (split them): " + ", ".join(
        f"{name} ({n} lines)" for n, name in offenders)
