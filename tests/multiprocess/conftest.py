"""Markers for the multiprocess tier (also declared in pyproject.toml; repeated here so the tier
runs under a bare `pytest tests/multiprocess -p no:cacheprovider` too)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multiprocess: real processes talking over gloo on CPU")
