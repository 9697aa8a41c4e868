"""What setuptools would install, read without a build: every folder with an `__init__.py` under the
package roots is a package of the wheel, at the name its folder says, and the build needs no torch.

The roots are `megatron_hpc/` and the top-level folders that install inside its namespace (`launch/` as
`megatron_hpc.launch`, README "Layout"). The wheel itself is built and installed in test_wheel_install.py;
this is the fast guard against a package left out.
"""

from __future__ import annotations

import os
import tomllib

# setuptools' copy of distutils (its distutils-precedence.pth puts it first), the one a build runs
from distutils.core import run_setup
from pathlib import Path

import pytest
import setuptools

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "megatron_hpc"


def package_folders() -> dict[str, Path]:
    """Dotted name -> folder for each `__init__.py` folder under a root, derived from the tree alone."""
    found = {}
    for root in sorted(p.parent for p in REPO.glob("*/__init__.py")):
        prefix = NAMESPACE if root.name == NAMESPACE else f"{NAMESPACE}.{root.name}"
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found[".".join((prefix, *rel))] = init.parent
    return found


@pytest.fixture(scope="module")
def configured() -> setuptools.Distribution:
    """setup.py and setup.cfg as a build reads them, stopped before any command runs."""
    here = Path.cwd()
    try:
        os.chdir(REPO)  # setup.cfg is read from the working directory, as pip and build run it
        return run_setup(str(REPO / "setup.py"), stop_after="config")
    finally:
        os.chdir(here)


def test_every_package_folder_is_installed_at_its_name(configured: setuptools.Distribution) -> None:
    expected = package_folders()
    assert NAMESPACE + ".evaluate" in expected and NAMESPACE + ".launch" in expected  # the walk sees the tree
    installed = set(configured.packages or ())
    missing, extra = sorted(expected.keys() - installed), sorted(installed - expected.keys())
    assert not missing, f"folders with an __init__.py that the wheel would leave out: {missing}"
    assert not extra, f"packages setuptools lists with no __init__.py folder behind them: {extra}"
    build_py = configured.get_command_obj("build_py")
    build_py.ensure_finalized()
    for name, folder in expected.items():
        # setuptools' own lookup (longest package_dir prefix): the files installed as `name` come from `folder`
        assert (REPO / build_py.get_package_dir(name)).resolve() == folder.resolve(), name


def test_extension_builds_into_an_installed_package(configured: setuptools.Distribution) -> None:
    names = {ext.name: ext.sources for ext in configured.ext_modules or ()}
    assert names == {"megatron_hpc.data._helpers": ["csrc/helpers.cpp"]}
    assert "megatron_hpc.data" in (configured.packages or ())


def test_build_requirements_leave_torch_out() -> None:
    # The isolated build environment installs exactly these: torch here would pull a CUDA build on Linux.
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    names = {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in requires}
    assert "torch" not in names and "pybind11" in names and "setuptools" in names, requires
