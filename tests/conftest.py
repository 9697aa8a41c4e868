"""Fixtures shared by every test tier."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The `tiny` recipe's real corpus, built by `megatron-hpc data demo` into a temp folder.

    Returns the `--set` overrides that point the recipe at it.
    """
    out: Path = tmp_path_factory.mktemp("demo-data")
    proc = subprocess.run([sys.executable, "-m", "megatron_hpc", "data", "demo", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    prefix = proc.stdout.strip().splitlines()[-1]
    assert Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()
    return ["--set", f"data.path={prefix}", "--set", f"data.vocab_file={out / 'vocab.json'}",
            "--set", f"data.merge_file={out / 'merges.txt'}"]


@pytest.fixture(autouse=True)
def own_compile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets an empty shared compile cache: a compile phase one test ran must not make
    another test's submit skip its compile phase (the user's ~/.cache is never touched)."""
    root = tmp_path_factory.mktemp("compile-cache")
    monkeypatch.setenv("MEGATRON_HPC_CACHE_DIR", str(root))
    return root


def _worker_pids(run_dir: Path) -> dict[int, int]:
    """RANK -> pid of the trainer workers of a run folder on this machine (not torchrun itself)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"megatron_hpc" in cmd and str(run_dir).encode() in cmd and b"RANK" in env and \
                not any(c.endswith(b"torchrun") for c in cmd):
            found[int(env[b"RANK"])] = int(proc.name)
    return found


@pytest.fixture
def worker_pids() -> Callable[[Path], dict[int, int]]:
    """`worker_pids(run_dir)`: RANK -> pid of the run's trainer workers (all simulated nodes are this machine)."""
    return _worker_pids


@pytest.fixture(autouse=True)
def no_user_cluster_profile(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own ~/.config/megatron-hpc/cluster.yaml must not change what tests submit."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg-config")))
    monkeypatch.delenv("MEGATRON_HPC_CLUSTER_CONFIG", raising=False)
