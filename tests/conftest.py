"""Fixtures shared by every test tier."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
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
    # Workers a warm process forked (launch.warm_restart) keep its command line and environment: its registry.
    from megatron_hpc.warm_protocol import registered_workers

    for folder in Path(os.environ.get("TMPDIR") or "/tmp").glob("megatron-hpc-warm.*"):
        found.update({w.rank: w.pid for w in registered_workers(folder, run_dir=run_dir)})
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


_QUIET_BY_DEFAULT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
"""Warning categories a fresh `python -m megatron_hpc` does not print (Python's default filters)."""


@pytest.fixture
def cli_in_process(capfd: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`cli_in_process(*args, umask=None)`: `megatron-hpc ARGS` run by its main() in this process, as
    `python -m megatron_hpc ARGS` runs it but without a new interpreter importing torch and our modules again
    (2-3 s of CPU a call). Returns what a subprocess.run would: the exit code (argparse's SystemExit included), the
    output written to the process's stdout and stderr (file descriptors included), and the warnings a fresh
    process would print as stderr lines. Runs without torchrun's variables, under `umask` if given, and destroys a
    process group the command left. Where the process boundary is the point (an exit status, a signal, torchrun,
    a server), a test runs the real command instead."""
    from megatron_hpc.cli.main import main

    def run(*args: str, umask: int | None = None) -> subprocess.CompletedProcess[str]:
        capfd.readouterr()  # what the test printed before is not the command's
        code: int | str | None
        with monkeypatch.context() as env, warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("default")
            for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
                env.delenv(var, raising=False)
            old_umask = os.umask(umask) if umask is not None else None
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's usage errors, as the interpreter would turn them into a status
                code = exc.code
            finally:
                if old_umask is not None:
                    os.umask(old_umask)
                dist = sys.modules.get("torch.distributed")  # a launcher command never imports torch
                if dist is not None and dist.is_available() and dist.is_initialized():
                    dist.destroy_process_group()
        out = capfd.readouterr()
        err = out.err + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                                for w in shown if not issubclass(w.category, _QUIET_BY_DEFAULT))
        if isinstance(code, str):  # sys.exit("message"): printed, status 1
            err, code = err + code + "\n", 1
        return subprocess.CompletedProcess(["megatron-hpc", *args], code or 0, out.out, err)

    return run
