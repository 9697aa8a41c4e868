"""Local `tiny` runs started as a node starts them, shared by the hang, straggler and debug tests: the run folder
from `submit --dry-run`, its generated node script run with `bash node.sh run` (torchrun, the gloo workers and the
node watchdog beside them), and the wait for an iteration line. Plain functions, as tests/slurm/tiny_runs.py is for
the SLURM tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def local_env(**extra: str) -> dict[str, str]:
    """This process's environment without an enclosing job's SLURM_/SBATCH_ variables or another test's test-only
    knobs, one OpenMP thread per worker (two workers share a 2-core machine), then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "MEGATRON_HPC_TEST_ONLY"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def start_local_run(out: Path, sets: Sequence[str], **env: str) -> subprocess.Popen:
    """`submit --recipe tiny --dry-run --out OUT` with these --set items, then its node script's run phase in a
    session of its own (so a test can kill the whole group), stdout and stderr merged; `env` is added for the run."""
    args = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--dry-run", "--out", str(out)]
    for item in sets:
        args += ["--set", item]
    subprocess.run(args, check=True, capture_output=True, env=local_env())
    return subprocess.Popen(["bash", str(out / "node.sh"), "run"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=local_env(**env), start_new_session=True)


def wait_for_iteration(proc: subprocess.Popen, n: int, lines: list[str], timeout: float = 180) -> None:
    """Read the run's output into `lines` until iteration n is logged; fails with the output's tail if the run
    ends first or takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if f" iteration {n:8d}/" in line:
            return
        assert time.monotonic() < deadline, "".join(lines[-30:])
    tail = "".join(lines[-30:])
    raise AssertionError(f"the run ended before iteration {n}:\n{tail}")
