"""Operating a run on the real local SLURM cluster: status while running, cancel, hand-submitted scripts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_hpc", *args], capture_output=True, text=True,
                          timeout=timeout)


def status_json(run_dir: Path) -> dict:
    proc = cli("status", "--json", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def wait_for(predicate, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last}")


def test_status_debug_while_running_then_cancel(slurm_cluster, sacct_job, tmp_path, demo_data):
    # The site settings come from a cluster profile: its partition, sbatch line and setup line reach SLURM.
    profile = tmp_path / "cluster.yaml"
    profile.write_text("partition: debug\nsbatch: ['--comment=mhpc-profile-test']\n"
                       "setup: ['echo profile-setup-ran-on-$SLURMD_NODENAME']\nmax_requeues: 1\n")
    run_dir = tmp_path / "long"
    proc = cli("submit", "--recipe", "tiny", "--nodes", "2", "--platform", "cpu", "--cluster-config", str(profile),
               "--out", str(run_dir), "--json", "--set", "train.num_steps=100000", "--set", "train.log_interval=2",
               *demo_data)
    assert proc.returncode == 0, proc.stderr
    jobs = {j["phase"]: j["job_id"] for j in json.loads(proc.stdout)["jobs"]}

    def training():
        data = status_json(run_dir)
        states = {j["phase"]: j["state"] for j in data["jobs"]}
        p = data["progress"]
        return data if states["run"] == "RUNNING" and p and p["phase"] == "run" and p["iteration"] >= 4 else None

    data = wait_for(training, timeout=240, what="the run phase to log progress")
    run_job = next(j for j in data["jobs"] if j["phase"] == "run")
    # the two nodes the controller gave the job (which two is its choice), as scontrol names them
    held = subprocess.run(["scontrol", "show", "job", "-o", jobs["run"]], capture_output=True, text=True).stdout
    assert f" NodeList={run_job['nodes']} " in held and run_job["source"] == "scontrol", (run_job, held)
    assert re.fullmatch(r"node\[[1-4][-,][1-4]\]", run_job["nodes"]), run_job
    assert data["progress"]["train_iters"] == 100000 and data["progress"]["eta_s"] > 0
    human = cli("status", str(run_dir)).stdout
    assert "RUNNING" in human and "ETA" in human
    shown = subprocess.run(["scontrol", "show", "job", jobs["run"]], capture_output=True, text=True).stdout
    assert "Comment=mhpc-profile-test" in shown and "Partition=debug" in shown
    assert list(jobs) == ["run"]  # tiny on CPU compiles nothing: no compile phase
    batch_log = run_dir / "logs" / f"tiny-run-{jobs['run']}.out"  # the run.sbatch's --output
    assert "profile-setup-ran-on-" in batch_log.read_text()

    # Hang debugging through `srun --overlap` into the running job: every rank of both nodes answers.
    debug = cli("debug", str(run_dir), "--json", "--method", "signal", timeout=240)
    assert debug.returncode == 0, debug.stdout + debug.stderr
    report = json.loads(debug.stdout)
    world = data["plan"]["num_nodes"] * data["plan"]["workers_per_node"]
    assert report["job_id"] == jobs["run"] and report["missing"] == []
    assert sorted(r["rank"] for r in report["ranks"]) == list(range(world))
    assert all("megatron_hpc/train/" in r["stacks"] for r in report["ranks"])

    proc = cli("cancel", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cancelled"] == [jobs["run"]]
    record = sacct_job(jobs["run"], final=True, timeout=60)
    assert record["State"].startswith("CANCELLED")
    assert wait_for(lambda: all(j["state"].startswith(("CANCELLED", "COMPLETED"))
                                for j in status_json(run_dir)["jobs"]), timeout=30, what="states to settle")
    logs = cli("logs", str(run_dir), "--node", "1")
    assert " iteration " in logs.stdout


def test_dry_run_scripts_submitted_by_hand(slurm_cluster, sacct_job, tmp_path, demo_data):
    run_dir = tmp_path / "byhand"
    proc = cli("submit", "--recipe", "tiny", "--nodes", "2", "--platform", "cpu", "--partition", "debug",
               "--dry-run", "--out", str(run_dir), "--set", "train.num_steps=6", "--set", "train.log_interval=2",
               "--set", "launch.time_limit_min=10", "--set", "train.compile=true", "--set", "compile.num_steps=1",
               "--set", "train.compile_backend=aot_eager",  # the scripts are the subject, not inductor's kernels
               *demo_data)
    assert proc.returncode == 0, proc.stderr
    submitted = subprocess.run(["bash", str(run_dir / "submit.sh")], capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    ids = dict(line.split(" phase: job ") for line in submitted.stdout.splitlines() if " phase: job " in line)
    compile_rec = sacct_job(ids["compile"], final=True, timeout=240)
    run_rec = sacct_job(ids["run"], final=True, timeout=240)
    assert compile_rec["State"] == "COMPLETED" and run_rec["State"] == "COMPLETED"
    assert run_rec["Start"] >= compile_rec["End"]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines if r["phase"] == "run"] == [2, 4, 6]
