"""`submit --resume RUN` on the real local SLURM cluster: a finished run continues to more steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slurm


def _submit(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}
    proc = subprocess.run([sys.executable, "-m", "megatron_hpc", "submit", "--cluster", "slurm", "--partition",
                           "debug", "--wait", "--json", *args], capture_output=True, text=True, timeout=420, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_resume_continues_a_finished_run_from_its_checkpoint(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    sets = ["data.source=synthetic", "train.num_steps=6", "train.log_interval=1", "compile.enabled=false",
            "train.tensorboard=false"]
    first = _submit("--recipe", "tiny", "--nodes", "2", "--platform", "cpu", "--out", str(run_dir),
                    *[a for s in sets for a in ("--set", s)])
    assert [j["state"] for j in first["jobs"]] == ["COMPLETED"] and not first["resumed"]

    second = _submit("--resume", str(run_dir), "--set", "train.num_steps=10")
    assert second["resumed"] and second["run_dir"] == str(run_dir)
    assert [j["state"] for j in second["jobs"]] == ["COMPLETED"]
    assert second["jobs"][0]["job_id"] != first["jobs"][0]["job_id"]
    log = (run_dir / "logs" / "run-node0.log").read_text()
    assert "at iteration 6" in log.split("> loaded checkpoint", 1)[1].splitlines()[0]
    iterations = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert iterations == list(range(1, 11))  # 1-6, then 7-10 after the resume: none repeated, none missing
    record = json.loads((run_dir / "submission.json").read_text())
    assert [h["jobs"][0]["job_id"] for h in record["history"]] == [first["jobs"][0]["job_id"]]
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "10"
