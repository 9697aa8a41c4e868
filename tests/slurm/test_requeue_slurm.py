"""Preemption and requeue on the real local SLURM cluster.

Two-node `tiny` runs (synthetic data, no compile phase). One is signalled mid-way the way SLURM
warns a job before its time limit (USR2 to the job's steps), another is requeued by hand with
`scontrol requeue` (SIGTERM, then the job goes back to the queue). Both must come back under the
same job id, resume from their checkpoint and end at the last iteration with exactly the losses of a
run that was never interrupted, which runs beside the first one on the other two nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

NUM_STEPS = 24
SETS = ["data.source=synthetic", f"train.num_steps={NUM_STEPS}", "train.log_interval=1", "compile.enabled=false",
        "checkpoint.save_interval=8", "train.tensorboard=false"]
RUN_TIMEOUT_S = 420


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}


def submit(run_dir: Path) -> str:
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "2", "--platform", "cpu",
           "--cluster", "slurm", "--partition", "debug", "--json", "--out", str(run_dir)]
    for item in SETS:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (job,) = json.loads(proc.stdout)["jobs"]
    return job["job_id"]


def wait_for_iteration(run_dir: Path, iteration: int, timeout: float = RUN_TIMEOUT_S) -> None:
    log = run_dir / "logs" / "run-node1.log"  # the last rank prints the iteration lines
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and f"iteration {iteration:8d}/" in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"iteration {iteration} never logged in {log}")


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in rows if r.get("phase") == "run"}


def requeues(job_id: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    counts = [t.split("=", 1)[1] for t in out.split() if t.startswith("Restarts=")]
    return int(counts[0]) if counts else -1


def check_resumed(run_dir: Path, straight: Path, job_id: str, sacct_job) -> int:
    """The job ended COMPLETED after one requeue and matches the straight run; returns the resume step."""
    record = sacct_job(job_id, timeout=RUN_TIMEOUT_S, final=True)
    node0 = (run_dir / "logs" / "run-node0.log").read_text(errors="replace")
    assert record["State"] == "COMPLETED", node0[-3000:]
    assert requeues(job_id) == 1
    loaded = [line for line in node0.splitlines() if "> loaded checkpoint" in line]
    assert len(loaded) == 1, node0[-3000:]
    k = int(loaded[0].split("at iteration ")[1].split()[0])
    assert 0 < k < NUM_STEPS
    expected, got = losses(straight), losses(run_dir)
    assert max(got) == NUM_STEPS and max(expected) == NUM_STEPS
    for it in range(k + 1, NUM_STEPS + 1):
        assert got[it] == pytest.approx(expected[it], rel=1e-6, abs=0), it
    return k


@pytest.fixture(scope="module")
def straight(slurm_cluster, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    return run_dir, submit(run_dir)


def test_warning_signal_saves_requeues_and_resumes(straight, sacct_job, tmp_path):
    run_dir = tmp_path / "signalled"
    job_id = submit(run_dir)
    wait_for_iteration(run_dir, 4)
    # What SLURM does --signal=USR2@90 before the limit: USR2 to every process of the job's steps.
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    k = check_resumed(run_dir, straight[0], job_id, sacct_job)
    assert k > 4  # it stopped where the signal found it (the log line below says why)
    node0 = (run_dir / "logs" / "run-node0.log").read_text(errors="replace")
    assert f"> stopping at iteration {k} on signal SIGUSR2" in node0
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["action"], a["requeued"], a["iteration"]) for a in attempts] == [
        (0, "requeue", True, k), (1, "done", False, None)]
    assert sacct_job(straight[1], timeout=RUN_TIMEOUT_S, final=True)["State"] == "COMPLETED"


def test_scontrol_requeue_resumes_from_the_last_checkpoint(straight, sacct_job, tmp_path):
    run_dir = tmp_path / "requeued"
    job_id = submit(run_dir)
    wait_for_iteration(run_dir, 10)  # past the save at 8
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    k = check_resumed(run_dir, straight[0], job_id, sacct_job)
    assert k >= 8  # the interval save at 8, or the save the workers made on SIGTERM
