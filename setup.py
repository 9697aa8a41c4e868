"""Declares the C++ extension only; all package metadata lives in setup.cfg."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "megatron_hpc.data._helpers",
            ["csrc/helpers.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        ),
    ],
)
