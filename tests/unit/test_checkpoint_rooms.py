"""checkpoint/ is three rooms, each with a public face (its `__init__`): store (the Megatron layout on disk),
conversion (reshard, convert, the layouts) and foreign (other trainers' checkpoints, Hugging Face). Read from the
source (ast), so a lazy import counts as much as one at the top:

(a) outside a room, our library imports the room only through its face, and only names the face exports; tests and
    benchmarks may reach inside a room for what its face does not export, but take from the face what it does;
(b) nothing imports a private (`_name`) from another of our modules (a package's own private submodule, such as
    data/_helpers, the C++ extension under its typed facade, is the package's to import);
(c) rooms depend one way: foreign -> conversion -> store (summary.py, what `ckpt inspect` prints for every kind of
    checkpoint, sits above all three), and a room's modules import each other directly, never through their face;
(d) a face exports exactly what the library outside the room uses.
Each rule is a function over parsed imports, and a synthetic case below shows that each one fails.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = "megatron_hpc.checkpoint"
ORDER = ("store", "conversion", "foreign")
"""A room may import the rooms before it in this tuple, never one after it."""
LIBRARY = {"megatron_hpc": REPO / "megatron_hpc", "megatron_hpc.launch": REPO / "launch",
           "megatron_hpc.compile_cache": REPO / "compile_cache"}
TOOLS = {"tests": REPO / "tests", "benchmarks": REPO / "benchmarks"}
KNOWN_PRIVATE: set[tuple[str, str]] = set()
"""(file, name) pairs allowed to import a private name; empty, and it may only stay so."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Import:
    where: str
    """The importing file, relative to the repository."""
    importer: str
    module: str
    """The module after `from` (made absolute), or the one `import` names."""
    names: tuple[str, ...]
    """What `from module import ...` takes; () for `import module`."""
    line: int
    library: bool
    """The importer is our package (megatron_hpc, launch, compile_cache), not a test or benchmark."""


def read_imports(source: str, *, importer: str, where: str, library: bool, package: bool = False) -> list[Import]:
    """Every import statement in `source`, at any depth; relative ones made absolute. `from megatron_hpc.checkpoint
    import x` is read as `import megatron_hpc.checkpoint.x` (what it names is a room or summary.py, a module)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = importer.split(".")[: len(importer.split(".")) - node.level + (1 if package else 0)]
                module = ".".join([*base, module] if module else base)
            names = tuple(a.name for a in node.names)
            pairs = [(f"{module}.{n}", ()) for n in names] if module == CHECKPOINT else [(module, names)]
            found += [Import(where=where, importer=importer, module=m, names=n, line=node.lineno, library=library)
                      for m, n in pairs]
        elif isinstance(node, ast.Import):
            found += [Import(where=where, importer=importer, module=a.name, names=(), line=node.lineno,
                             library=library) for a in node.names]
    return found


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
    return ".".join([package, *parts])


@functools.cache
def all_imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for library, roots in ((True, LIBRARY), (False, TOOLS)):
        for package, root in roots.items():
            for path in sorted(root.rglob("*.py")):
                found += read_imports(path.read_text(encoding="utf-8"), importer=_module_name(package, root, path),
                                      where=path.relative_to(REPO).as_posix(), library=library,
                                      package=path.name == "__init__.py")
    return tuple(found)


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if module.startswith(CHECKPOINT + ".") and parts[2] in ORDER else None


def face(room: str) -> dict[str, str]:
    """What the room's `__init__` exports: name -> the module it comes from (a module exported whole: itself).
    Read from the source: the eager faces' imports, or the lazy face's _MODULES and _EXPORTS."""
    package = f"{CHECKPOINT}.{room}"
    tree = ast.parse((REPO / "megatron_hpc" / "checkpoint" / room / "__init__.py").read_text(encoding="utf-8"))
    exports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            for alias in node.names:
                whole = node.module == package
                exports[alias.asname or alias.name] = f"{package}.{alias.name}" if whole else node.module
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            name = target.id if isinstance(target, ast.Name) else ""
            if name == "_MODULES":
                exports.update({m: f"{package}.{m}" for m in ast.literal_eval(node.value)})
            elif name == "_EXPORTS":
                exports.update({n: f"{package}.{m}" for m, names in ast.literal_eval(node.value).items()
                                for n in names})
    return exports


def submodules(room: str) -> set[str]:
    folder = REPO / "megatron_hpc" / "checkpoint" / room
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {p.name for p in folder.iterdir()
                                                                            if (p / "__init__.py").is_file()}


def face_violations(imports: Sequence[Import], faces: dict[str, dict[str, str]],
                    rooms: dict[str, set[str]]) -> list[str]:
    """Rule (a), and (c)'s second half: a room's own modules import each other, not names from their face."""
    bad = []
    for imp in imports:
        room = room_of(imp.module)
        if room is None:
            continue
        at = f"{imp.where}:{imp.line}"
        package = f"{CHECKPOINT}.{room}"
        if room_of(imp.importer) == room:
            if imp.module == package and not set(imp.names) <= rooms[room]:
                bad.append(f"{at} imports {sorted(set(imp.names) - rooms[room])} from its own room's face; "
                           f"import the sibling module that defines them")
            continue
        if imp.library:
            outside = [n for n in imp.names if n not in faces[room]]
            if imp.module != package or not imp.names or outside:
                what = f"{imp.module}: {', '.join(outside or imp.names) or '(module)'}"
                bad.append(f"{at} reaches inside {package} ({what}); import from {package}, adding the name "
                           "to its face if the library needs it")
        else:
            on_face = [n for n in imp.names if faces[room].get(n) == imp.module]
            if imp.module != package and on_face:
                bad.append(f"{at} imports {on_face} from {imp.module}; {package} exports them, import from there")
    return bad


def order_violations(imports: Sequence[Import]) -> list[str]:
    """Rule (c): a room imports only the rooms before it in ORDER, and never summary.py (above all rooms)."""
    bad = []
    for imp in imports:
        mine, theirs = room_of(imp.importer), room_of(imp.module)
        if mine is None:
            continue
        above = theirs is not None and ORDER.index(theirs) > ORDER.index(mine)
        if above or imp.module.startswith(f"{CHECKPOINT}.summary"):
            bad.append(f"{imp.where}:{imp.line}: {mine} imports {imp.module}, which depends on it; rooms depend "
                       f"{' <- '.join(ORDER)} only")
    return bad


def private_imports(imports: Sequence[Import], ours: set[str]) -> set[tuple[str, str]]:
    """Rule (b): (file, module.name) of each private name taken from another of our modules. `ours`: top-level
    names that are our modules (megatron_hpc, and the test and benchmark modules importable by file name)."""
    found = set()
    for imp in imports:
        if imp.module.split(".")[0] not in ours:
            continue
        parts = imp.module.split(".")
        private_part = any(p.startswith("_") and not p.startswith("__") for p in parts)
        names = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        own_package = imp.importer.rsplit(".", 1)[0] == imp.module  # `from megatron_hpc.data import _helpers`
        if names and not own_package:
            found.update((imp.where, f"{imp.module}.{n}") for n in names)
        if private_part and imp.importer.rsplit(".", 1)[0] != imp.module.rsplit(".", 1)[0]:
            found.add((imp.where, imp.module))
    return found


def unused_exports(imports: Sequence[Import], faces: dict[str, dict[str, str]]) -> list[str]:
    """Rule (d): names a face exports that no library module outside its room imports."""
    used = {(room_of(i.module), n) for i in imports if i.library and room_of(i.module) != room_of(i.importer)
            for n in i.names}
    return [f"{CHECKPOINT}.{room} exports {name}, which nothing outside the room imports; drop it from the face"
            for room, exports in faces.items() for name in exports if (room, name) not in used]


def _faces() -> dict[str, dict[str, str]]:
    return {room: face(room) for room in ORDER}


def _rooms() -> dict[str, set[str]]:
    return {room: submodules(room) for room in ORDER}


def _ours() -> set[str]:
    return {"megatron_hpc"} | {p.stem for root in TOOLS.values() for p in root.rglob("*.py")}


def test_the_library_and_the_tests_go_through_the_faces() -> None:
    assert face_violations(all_imports(), _faces(), _rooms()) == []


def test_rooms_depend_one_way() -> None:
    assert order_violations(all_imports()) == []


def test_no_private_name_crosses_modules() -> None:
    found = private_imports(all_imports(), _ours())
    assert found - KNOWN_PRIVATE == set(), "import a public name; make it public where it is defined if others need it"
    assert KNOWN_PRIVATE - found == set(), "these no longer import a private name: delete them from KNOWN_PRIVATE"


def test_each_face_exports_what_the_library_uses_and_no_more() -> None:
    assert unused_exports(all_imports(), _faces()) == []


@pytest.mark.parametrize("room", ORDER)
def test_the_face_read_from_source_is_the_face_python_sees(room: str) -> None:
    """face() reads the source; the package's __all__ and its attributes are what an importer gets."""
    import importlib

    package = importlib.import_module(f"{CHECKPOINT}.{room}")
    exports = face(room)
    assert sorted(package.__all__) == sorted(exports)
    for name, home in exports.items():
        value = getattr(package, name)
        if home == f"{CHECKPOINT}.{room}.{name}":
            assert value is importlib.import_module(home)
        else:
            assert value is getattr(importlib.import_module(home), name)


def test_the_store_face_and_the_checkpoint_package_import_without_torch() -> None:
    """The launcher reads the tracker and `submit` checks a checkpoint's fit through the store face, torch-free."""
    code = ("import sys\n"
            "import megatron_hpc.checkpoint\n"
            "from megatron_hpc.checkpoint.store import PipelineLayout, check_before_queue, parse_tracker, paths\n"
            "import megatron_hpc.launch.run_status\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------ each rule can fail

def _synthetic(source: str, *, importer: str, library: bool = True) -> list[Import]:
    return read_imports(source, importer=importer, where=importer.replace(".", "/") + ".py", library=library)


FACES = {"store": {"save_checkpoint": f"{CHECKPOINT}.store.saver", "paths": f"{CHECKPOINT}.store.paths"},
         "conversion": {"read_whole": f"{CHECKPOINT}.conversion.whole"}, "foreign": {}}
ROOMS = {"store": {"saver", "paths", "xser"}, "conversion": {"whole"}, "foreign": set()}


def test_the_face_rule_catches_a_reach_inside() -> None:
    inside = _synthetic("def f():\n    from megatron_hpc.checkpoint.store.saver import save_checkpoint\n",
                        importer="megatron_hpc.train.checkpointing")
    assert len(face_violations(inside, FACES, ROOMS)) == 1
    not_exported = _synthetic("from megatron_hpc.checkpoint.store import xser\n", importer="megatron_hpc.cli.x")
    assert len(face_violations(not_exported, FACES, ROOMS)) == 1
    plain = _synthetic("import megatron_hpc.checkpoint.store.saver\n", importer="megatron_hpc.cli.x")
    assert len(face_violations(plain, FACES, ROOMS)) == 1
    own_face = _synthetic("from megatron_hpc.checkpoint.store import save_checkpoint\n",
                          importer=f"{CHECKPOINT}.store.loader")
    assert len(face_violations(own_face, FACES, ROOMS)) == 1
    test_past_face = _synthetic("from megatron_hpc.checkpoint.store.saver import save_checkpoint, write_tracker\n",
                                importer="tests.unit.test_x", library=False)
    assert len(face_violations(test_past_face, FACES, ROOMS)) == 1
    fine = _synthetic("from megatron_hpc.checkpoint.store import paths, xser\n", importer=f"{CHECKPOINT}.store.loader")
    fine += _synthetic("from megatron_hpc.checkpoint.store import paths, save_checkpoint\n",
                       importer="megatron_hpc.train.x")
    fine += _synthetic("from megatron_hpc.checkpoint.store.saver import write_tracker\n", importer="tests.unit.y",
                       library=False)
    assert face_violations(fine, FACES, ROOMS) == []


def test_the_order_rule_catches_an_upward_import() -> None:
    up = _synthetic("from megatron_hpc.checkpoint.conversion import read_whole\n", importer=f"{CHECKPOINT}.store.x")
    assert len(order_violations(up)) == 1
    summary = _synthetic("from megatron_hpc.checkpoint.summary import summarize\n"
                         "from megatron_hpc.checkpoint import summary\n", importer=f"{CHECKPOINT}.foreign.x")
    assert len(order_violations(summary)) == 2
    by_package = _synthetic("from megatron_hpc.checkpoint import foreign\n", importer=f"{CHECKPOINT}.conversion.x")
    assert len(order_violations(by_package)) == 1
    down = _synthetic("from megatron_hpc.checkpoint.store import paths\n"
                      "from megatron_hpc.checkpoint.conversion import read_whole\n", importer=f"{CHECKPOINT}.foreign.x")
    assert order_violations(down) == []


def test_the_private_rule_catches_a_private_import() -> None:
    crossing = _synthetic("from megatron_hpc.checkpoint.store.saver import _finish, commit_save\n",
                          importer=f"{CHECKPOINT}.conversion.whole")
    assert {n for _, n in private_imports(crossing, {"megatron_hpc"})} == {f"{CHECKPOINT}.store.saver._finish"}
    helper = _synthetic("from test_checkpoint_import import _reference\n", importer="tests.unit.test_y",
                        library=False)
    assert len(private_imports(helper, {"megatron_hpc", "test_checkpoint_import"})) == 1
    own_package = _synthetic("from megatron_hpc.data import _helpers\n", importer="megatron_hpc.data.helpers")
    third_party = _synthetic("from pickle import _Pickler\n", importer="megatron_hpc.checkpoint.store.xser")
    assert private_imports(own_package + third_party, {"megatron_hpc"}) == set()


def test_the_export_rule_catches_an_unused_export() -> None:
    used = _synthetic("from megatron_hpc.checkpoint.store import paths, save_checkpoint\n"
                      "from megatron_hpc.checkpoint.conversion import read_whole\n", importer="megatron_hpc.cli.x")
    assert unused_exports(used, FACES) == []
    assert len(unused_exports(used[:1], FACES)) == 1  # read_whole is no longer imported by anyone
