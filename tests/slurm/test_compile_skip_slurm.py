"""On the real local SLURM cluster: once a compile phase succeeded, the same run skips it; a run
whose graphs differ (another batch size) does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

SETS = ["data.source=synthetic", "train.num_steps=4", "compile.num_steps=2", "train.log_interval=1",
        "train.tensorboard=false"]


def submit(run_dir: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "1", "--platform", "cpu",
           "--cluster", "slurm", "--partition", "debug", "--wait", "--json", "--out", str(run_dir)]
    for item in [*SETS, *extra]:
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_second_submit_skips_the_compile_job(slurm_cluster, sacct_job, tmp_path, own_compile_cache):
    first = submit(tmp_path / "first")
    assert [j["phase"] for j in first["jobs"]] == ["compile", "run"] and not first["compile_skipped"]
    markers = list((own_compile_cache / "megatron-hpc" / "fingerprints").glob("*.json"))
    assert [m.stem for m in markers] == [first["fingerprint"]]
    assert json.loads(markers[0].read_text())["job_id"] == first["jobs"][0]["job_id"]

    second = submit(tmp_path / "second", "train.num_steps=6", "optim.lr=5e-4")  # same graphs
    assert second["compile_skipped"] and second["fingerprint"] == first["fingerprint"]
    (run,) = second["jobs"]
    assert run["phase"] == "run" and run["depends_on"] is None
    assert sacct_job(run["job_id"], final=True)["State"] == "COMPLETED"
    assert not (tmp_path / "second" / "logs" / "compile-node0.log").exists()

    third = submit(tmp_path / "third", "train.global_batch_size=16")
    assert not third["compile_skipped"] and third["fingerprint"] != first["fingerprint"]
    assert [j["phase"] for j in third["jobs"]] == ["compile", "run"]
    assert all(j["state"] == "COMPLETED" for j in third["jobs"])
