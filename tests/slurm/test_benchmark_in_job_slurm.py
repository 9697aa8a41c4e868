"""The smoke run of benchmarks/in_job_restart.py: one round on the local cluster (it needs a SLURM controller, so it
runs here rather than in tests/unit/test_benchmark_smoke.py). Its figures are the benchmark's business; this checks
that both recoveries complete and the table with its ratio comes out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "in_job_restart.py"


def test_in_job_restart_benchmark_runs_one_round_and_prints_its_ratio(slurm_cluster) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1"], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    for mode in ("in-job restart", "requeue"):
        (row,) = [line for line in lines if line.startswith(mode)]
        assert len(re.findall(r"\d+\.\d\ds", row)) == 6, row  # five phases and the total, in seconds
    assert re.search(r"^in-job / requeue: \d+\.\d\dx", proc.stdout, re.M), proc.stdout
