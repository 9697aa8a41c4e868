"""The package layout and the C++ extension; all package metadata lives in setup.cfg.

Packages are discovered, never listed: every folder with an `__init__.py` under a root below is installed,
so a new subpackage ships without an edit here (tests/unit/test_package_discovery.py holds this to the tree).
`launch/`, `compile_cache/`, `recipes/` and `slurm/` live at the top of the repository but install inside the
`megatron_hpc` namespace. Data files (recipes, sbatch templates, py.typed) come from MANIFEST.in through
setup.cfg's include_package_data.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import find_packages, setup

NAMESPACE = "megatron_hpc"
ROOTS = {
    NAMESPACE: "megatron_hpc",
    f"{NAMESPACE}.launch": "launch",
    f"{NAMESPACE}.compile_cache": "compile_cache",
    f"{NAMESPACE}.recipes": "recipes",
    f"{NAMESPACE}.slurm": "slurm",
}
"""Installed name -> folder (relative to this file) of each package root."""


def discover_packages() -> list[str]:
    """Each root and every `__init__.py` folder below it, under its installed name."""
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        found.extend(f"{name}.{sub}" for sub in find_packages(where=folder))
    return sorted(found)


setup(
    package_dir=ROOTS,
    packages=discover_packages(),
    ext_modules=[
        Pybind11Extension(
            f"{NAMESPACE}.data._helpers",
            ["csrc/helpers.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
    ],
)
