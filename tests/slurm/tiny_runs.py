"""Two-node `tiny` runs on the local cluster, shared by the requeue and hot-spare tests: submitting one, reading
its job, waiting for an iteration. Plain functions; the cluster itself is conftest.py's fixture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def clean_env() -> dict[str, str]:
    """This process's environment without the SLURM_/SBATCH_ variables of an enclosing job (SLURM_CONF kept), so
    that a submit from a test never inherits a job it is not part of."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}


def submit_tiny(run_dir: Path, sets: Sequence[str]) -> str:
    """`submit --recipe tiny --nodes 2` on the debug partition with these --set items; the job id."""
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "2", "--platform", "cpu",
           "--cluster", "slurm", "--partition", "debug", "--json", "--out", str(run_dir)]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job,) = json.loads(proc.stdout)["jobs"]
    return job["job_id"]


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict; empty once the controller forgot the job."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(t.split("=", 1) for t in out.split() if "=" in t)


def wait_for_iteration(run_dir: Path, iteration: int, timeout: float) -> None:
    log = run_dir / "logs" / "run-node1.log"  # the last rank prints the iteration lines
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and f"iteration {iteration:8d}/" in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"iteration {iteration} never logged in {log}")
