"""`megatron-hpc submit` on the real local SLURM cluster: two phases, afterok, two nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

SUBMIT_TIMEOUT_S = 420


def submit(run_dir: Path, data: list[str], *extra: str) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "2",
           "--platform", "cpu", "--cluster", "slurm", "--partition", "debug", "--wait", "--json",
           "--out", str(run_dir), "--set", "train.num_steps=30", "--set", "train.log_interval=5", *data, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"submit printed no JSON (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.returncode, report, proc.stderr


def jobs_by_phase(report: dict) -> dict[str, dict]:
    return {job["phase"]: job for job in report["jobs"]}


def test_tiny_on_two_nodes_compiles_then_trains(slurm_cluster, sacct_job, tmp_path, demo_data):
    run_dir = tmp_path / "run"
    code, report, stderr = submit(run_dir, demo_data)
    assert code == 0, f"{report}\n{stderr}"
    jobs = jobs_by_phase(report)
    assert jobs["run"]["depends_on"] == jobs["compile"]["job_id"]

    compile_rec = sacct_job(jobs["compile"]["job_id"], final=True)
    run_rec = sacct_job(jobs["run"]["job_id"], final=True, until=lambda r: r["NodeList"] == "node[1-2]")
    assert compile_rec["State"] == "COMPLETED" and run_rec["State"] == "COMPLETED"
    # afterok: the run phase started only once the compile phase had ended (ISO times sort as text)
    assert run_rec["Start"] >= compile_rec["End"], (compile_rec, run_rec)

    # both nodes took part in each phase, each with its own log
    for phase in ("compile", "run"):
        for node in (0, 1):
            assert (run_dir / "logs" / f"{phase}-node{node}.log").exists()

    # the last rank (on node 1) logs Megatron's iteration line, and the loss falls
    run_log = (run_dir / "logs" / "run-node1.log").read_text()
    assert "iteration       30/      30 |" in run_log
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run_steps = [s for s in steps if s["phase"] == "run"]
    assert [s["iteration"] for s in run_steps] == [5, 10, 15, 20, 25, 30]
    assert run_steps[-1]["lm_loss"] < 0.8 * run_steps[0]["lm_loss"], run_steps
    compile_steps = [s for s in steps if s["phase"] == "compile"]
    assert compile_steps and max(s["iteration"] for s in compile_steps) <= 3  # the short trial


def test_failed_compile_means_the_run_never_starts(slurm_cluster, sacct_job, tmp_path, demo_data):
    run_dir = tmp_path / "bad"
    # An absurd learning rate without clipping makes every loss after the first step non-finite:
    # a real trainer failure in the compile phase's trial run.
    code, report, _stderr = submit(run_dir, demo_data, "--set", "optim.lr=1e30", "--set", "optim.clip_grad=0",
                                  "--set", "optim.lr_warmup_iters=0",
                                  "--set", "train.max_skipped_steps=2")
    assert code == 1
    jobs = jobs_by_phase(report)
    assert jobs["compile"]["state"] == "FAILED"
    assert jobs["run"]["state"] == "CANCELLED"
    assert "compile phase" in report["reason"] and "loss" in report["reason"]
    run_rec = sacct_job(jobs["run"]["job_id"], final=True)
    assert run_rec["State"].startswith("CANCELLED")
    assert run_rec["Start"] in ("None", "Unknown") or run_rec["NodeList"] == "None assigned"
    assert not (run_dir / "logs" / "run-node0.log").exists()
