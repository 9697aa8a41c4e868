"""The wheel as a user gets it: built from the sdist, installed (not editable) into a fresh venv with torch from
the same pin, and run from a folder outside the checkout.

Every other test imports the editable checkout, where a package left out of the wheel still imports. Here the
sdist and the wheel are built as `pip install .` builds them (isolated: setuptools and pybind11, no torch), the
wheel is installed with its declared dependencies only, and every subcommand's `--help`, `data demo`, a short
`submit --cluster local` and `evaluate` on its checkpoint run from the venv. One venv for the module: its
build and torch's install run side by side (a compile and an unpack).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_hpc.cli.main import COMMANDS

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "megatron_hpc"


def _shipped(root: Path) -> list[Path]:
    """Files under a package root that ship: not what an editable install or a run leaves in a checkout
    (bytecode, the in-place extension; MANIFEST.in excludes them too)."""
    return [p for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")]


def _roots() -> list[Path]:
    """megatron_hpc/ and the top-level folders that install inside its namespace (README "Layout")."""
    return sorted(p.parent for p in REPO.glob("*/__init__.py"))


@dataclasses.dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path
    sdist: Path
    build_log: Path
    outside: Path
    """The working directory of every command: not the checkout, so nothing imports from it."""

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        # Bytecode is written (PYTHONDONTWRITEBYTECODE dropped): torch went in uncompiled (`installed`), so the
        # first command to import a module compiles it once for the later ones, in the temporary venv only.
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return subprocess.run([str(self.venv / "bin" / args[0]), *args[1:]], cwd=self.outside, env=env,
                              capture_output=True, text=True, timeout=timeout)


def _pip(venv: Path, *args: str, hint: str = "") -> None:
    # The running pip installs into the venv (`--python`): the venv needs no pip of its own, which saves ensurepip.
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"pip install {' '.join(args)} failed{hint}:\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    dist, venv, outside = (tmp_path_factory.mktemp(name) for name in ("dist", "venv", "outside"))
    assert REPO not in outside.parents, f"the test's temp folder {outside} lies in the checkout; use --basetemp"
    log = dist / "build.log"
    with open(log, "w") as out:
        # No --sdist/--wheel: build makes the sdist, then the wheel from the unpacked sdist, so a file the sdist
        # forgets fails the wheel's build. The sdist step writes megatron_hpc.egg-info/ into the checkout, as
        # `pip install -e .` does (git ignores it).
        build = subprocess.Popen([sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)],
                                 stdout=out, stderr=subprocess.STDOUT)
        try:
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
            # The same torch build as this environment's (e.g. 2.13.0+cpu): a bare pin could fetch a CUDA build.
            torch = f"torch=={importlib.metadata.version('torch')}"
            # --no-compile: compiling all of torch's ~5000 modules took 19 of the install's 28 CPU seconds; the
            # commands below import a few hundred of them and compile those once as they go (Installed.run).
            _pip(venv, "--no-compile", torch,
                 hint=f"; put the {torch} wheel where pip finds it (its find-links, README)")
            assert build.wait(timeout=900) == 0, f"python -m build failed:\n{log.read_text()[-3000:]}"
        finally:
            if build.poll() is None:
                build.kill()
    (wheel,), (sdist,) = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    _pip(venv, str(wheel))
    return Installed(venv=venv, wheel=wheel, sdist=sdist, build_log=log, outside=outside)


def _source_files() -> dict[str, Path]:
    """Installed path (as in the wheel) -> file, for every file under the package roots."""
    found = {}
    for root in _roots():
        prefix = Path(NAMESPACE) if root.name == NAMESPACE else Path(NAMESPACE, root.name)
        for path in _shipped(root):
            found[(prefix / path.relative_to(root)).as_posix()] = path
    return found


def test_wheel_carries_every_module_data_file_and_the_extension(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    expected = _source_files()
    for must in ("megatron_hpc/evaluate/__init__.py", "megatron_hpc/recipes/tiny.yaml", "megatron_hpc/py.typed",
                 "megatron_hpc/slurm/templates/phase.sbatch", "megatron_hpc/slurm/templates/node.sh"):
        assert must in expected, f"{must} is not in the checkout: the walk of the package roots is broken"
    missing = sorted(expected.keys() - names)
    assert not missing, f"files of the package roots the wheel leaves out: {missing}"
    assert [n for n in names if re.fullmatch(r"megatron_hpc/data/_helpers\..*\.so", n)], "no compiled _helpers"


def test_sdist_carries_what_the_build_needs(installed: Installed) -> None:
    with tarfile.open(installed.sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.removeprefix(top + "/") for n in tar.getnames()}
    for needed in ("csrc/helpers.cpp", "setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md"):
        assert needed in names, f"the sdist has no {needed}"
    tree = {p.relative_to(REPO).as_posix() for root in _roots() for p in _shipped(root)}
    assert not tree - names, f"the sdist leaves out {sorted(tree - names)}"
    # What each isolated build environment (the sdist's, the wheel's) installed: pybind11, never torch.
    requirements = re.findall(r"^  - (\S+)$", installed.build_log.read_text(), re.M)
    assert requirements and any(r.startswith("pybind11") for r in requirements), requirements
    assert not [r for r in requirements if r.startswith("torch")], requirements


def test_installed_modules_import_from_the_venv_with_declared_dependencies(installed: Installed) -> None:
    # Every module of the wheel imports with only the dependencies it declares; a module behind an extra says
    # which one (its one-line MegatronHpcError), and that extra exists. The extension and the package resolve to
    # the venv's site-packages, not the checkout.
    script = """
import importlib, importlib.metadata, json, pkgutil, sysconfig
import megatron_hpc
from megatron_hpc.data import helpers
from megatron_hpc.errors import MegatronHpcError
failed = {}
for mod in pkgutil.walk_packages(megatron_hpc.__path__, "megatron_hpc."):
    if not mod.name.endswith(".__main__"):
        try:
            importlib.import_module(mod.name)
        except MegatronHpcError as exc:
            failed[mod.name] = str(exc)
native = helpers.native()
extras = importlib.metadata.metadata("megatron-hpc").get_all("Provides-Extra")
print(json.dumps({"site": sysconfig.get_paths()["purelib"], "package": megatron_hpc.__file__,
                  "helpers": native and native.__file__, "failed": failed, "extras": extras}))
"""
    proc = installed.run("python", "-c", script, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    site = Path(found["site"])
    assert site.is_relative_to(installed.venv), found
    assert Path(found["package"]).is_relative_to(site), found
    assert found["helpers"] and Path(found["helpers"]).is_relative_to(site), found
    for name, message in found["failed"].items():
        named = re.search(r"pip install 'megatron-hpc\[(\w+)\]'", message)
        assert named and named.group(1) in (found["extras"] or ()), f"{name} does not import from the wheel: {message}"


def test_every_subcommand_help_runs(installed: Installed) -> None:
    top = installed.run("megatron-hpc", "--help")
    assert top.returncode == 0, top.stderr
    # One process per command, a core each: each --help imports only its own command's module.
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        helps = dict(zip(COMMANDS, pool.map(lambda name: installed.run("megatron-hpc", name, "--help"), COMMANDS)))
    for name, proc in helps.items():
        assert re.search(rf"^\s+{name}\s", top.stdout, re.M), f"megatron-hpc --help does not list {name}"
        assert proc.returncode == 0 and f"usage: megatron-hpc {name}" in proc.stdout, (name, proc.stderr[-2000:])


def test_demo_data_trains_and_evaluates_from_the_wheel(installed: Installed) -> None:
    demo = installed.outside / "demo"
    made = installed.run("megatron-hpc", "data", "demo", "--out", str(demo), timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    prefix = made.stdout.strip().splitlines()[-1]
    assert Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file(), made.stdout
    run = installed.outside / "run"
    sets = [f"data.path={prefix}", f"data.vocab_file={demo / 'vocab.json'}", f"data.merge_file={demo / 'merges.txt'}",
            "train.num_steps=2", "train.global_batch_size=4", "train.log_interval=1", "train.eval_iters=1"]
    submit = installed.run("megatron-hpc", "submit", "--recipe", "tiny", "--cluster", "local", "--out", str(run),
                           *[arg for s in sets for arg in ("--set", s)], timeout=600)
    assert submit.returncode == 0, (submit.stdout + submit.stderr)[-3000:]
    # The workers ran the venv's Python: the node script puts its bin first on PATH.
    assert f"export PATH={installed.venv / 'bin'}:" in (run / "node.sh").read_text()
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in records if r["phase"] == "run"]
    assert len(losses) == 2 and all(math.isfinite(x) and 0 < x < 20 for x in losses), losses
    (tested,) = [r["lm_loss"] for r in records if r["phase"] == "test"]
    # megatron_hpc.evaluate from the wheel: the split the run evaluated at its end, from its checkpoint
    evaluated = installed.run("megatron-hpc", "evaluate", str(run / "checkpoints"), "--split", "test", "--json",
                              timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout)["splits"]["test"]["loss"] == pytest.approx(tested, rel=2e-6)
