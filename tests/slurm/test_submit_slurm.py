"""`megatron-hpc submit` on the real local SLURM cluster: two phases, afterok, two nodes; the sbatch files of
the run folder are what SLURM runs, with a cluster profile's settings; a failure is explained by its cause.

On CPU a run has a compile phase only with torch.compile (`train.compile=true`); without it there is nothing to
compile and only the run phase is queued.
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

SUBMIT_TIMEOUT_S = 420
COMPILE = ["--set", "train.compile=true"]
# torch.compile with aot_eager: the phases, their order and the trial are what these tests are about, and inductor's
# kernels took ~50 s of each two-rank compile phase on two cores; tests/slurm/test_compile_skip_slurm.py runs
# inductor and its shared cache for real.
QUICK_COMPILE = [*COMPILE, "--set", "train.compile_backend=aot_eager"]


def submit_command(run_dir: Path, data: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "2",
            "--platform", "cpu", "--cluster", "slurm", "--partition", "debug", "--wait", "--json",
            "--out", str(run_dir), "--set", "train.num_steps=30", "--set", "train.log_interval=5", *data, *extra]


def submit(run_dir: Path, data: list[str], *extra: str) -> tuple[int, dict, str]:
    proc = subprocess.run(submit_command(run_dir, data, *extra), capture_output=True, text=True,
                          timeout=SUBMIT_TIMEOUT_S)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"submit printed no JSON (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.returncode, report, proc.stderr


def jobs_by_phase(report: dict) -> dict[str, dict]:
    return {job["phase"]: job for job in report["jobs"]}


def test_tiny_on_two_nodes_compiles_then_trains(slurm_cluster, sacct_job, tmp_path, demo_data):
    run_dir = tmp_path / "run"
    code, report, stderr = submit(run_dir, demo_data, *QUICK_COMPILE)
    assert code == 0, f"{report}\n{stderr}"
    jobs = jobs_by_phase(report)
    assert jobs["run"]["depends_on"] == jobs["compile"]["job_id"]
    # what was queued is the run folder's files, with submit.sh's command lines
    recorded = jobs_by_phase(json.loads((run_dir / "submission.json").read_text()))
    assert recorded["compile"]["command"] == ["sbatch", "--parsable", str(run_dir / "compile.sbatch")]
    assert recorded["run"]["command"] == ["sbatch", "--parsable", f"--dependency=afterok:{jobs['compile']['job_id']}",
                                          "--kill-on-invalid-dep=yes", str(run_dir / "run.sbatch")]

    # until both nodes are in the record (for a moment after a short job slurmdbd may name only the batch node);
    # which two depends on what earlier tests left draining
    compile_rec = sacct_job(jobs["compile"]["job_id"], final=True)
    run_rec = sacct_job(jobs["run"]["job_id"], final=True, until=lambda r: "[" in r["NodeList"])
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
    # aot_eager: the failure is the trainer's, not the compiler's, so nothing needs inductor's minutes of kernels
    code, report, _stderr = submit(run_dir, demo_data, *QUICK_COMPILE,
                                  "--set", "optim.lr=1e30", "--set", "optim.clip_grad=0",
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


def scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return dict(tok.split("=", 1) for tok in out.stdout.split() if "=" in tok)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}


PROFILE = """\
partition: debug
account: mhpc-test
qos: mhpc-high
constraint: rack2
exclude: node3
time_limit_min: {compile: 7, run: 12}
sbatch: ["--comment=mhpc-profile-check", "--mail-type=END"]
"""


def test_a_cluster_profile_reaches_slurm_through_the_sbatch_files(slurm_cluster, sacct_job, tmp_path):
    """Every profile setting, as the controller recorded it for both jobs (slurm/local-cluster-start.sh makes
    the account, QOS and node features real, and enforces them)."""
    profile = tmp_path / "cluster.yaml"
    profile.write_text(PROFILE)
    run_dir = tmp_path / "profiled"
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "1", "--platform", "cpu",
           "--cluster-config", str(profile), "--json", "--out", str(run_dir), *COMPILE,
           "--set", "data.source=synthetic", "--set", "train.num_steps=2", "--set", "compile.num_steps=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = jobs_by_phase(json.loads(proc.stdout))
    try:
        fields = {phase: scontrol_job(job["job_id"]) for phase, job in jobs.items()}
        for phase, minutes in (("compile", "00:07:00"), ("run", "00:12:00")):
            job = fields[phase]
            assert (job["Partition"], job["Account"], job["QOS"]) == ("debug", "mhpc-test", "mhpc-high"), job
            assert (job["Features"], job["ExcNodeList"]) == ("rack2", "node3"), job
            assert job["TimeLimit"] == minutes and job["Comment"] == "mhpc-profile-check", job
            assert job["MailType"] == "END", job
            # the very file of the run folder, run where submit ran, logging into the run folder
            assert job["Command"] == str(run_dir / f"{phase}.sbatch"), job
            assert job["WorkDir"] == os.getcwd(), job
            assert job["StdOut"] == str(run_dir / "logs" / f"tiny-{phase}-{jobs[phase]['job_id']}.out"), job
        assert fields["run"]["Dependency"].startswith(f"afterok:{jobs['compile']['job_id']}"), fields["run"]
        assert fields["run"]["KillOInInvalidDependent"] == "Yes", fields["run"]
        # rack2 is node3 and node4, and node3 is excluded
        deadline = time.monotonic() + 120
        while (nodes := scontrol_job(jobs["compile"]["job_id"])["NodeList"]) in ("", "(null)"):
            assert time.monotonic() < deadline, "the compile job never started"
            time.sleep(1)
        assert nodes == "node4"
    finally:
        subprocess.run(["scancel", *(j["job_id"] for j in jobs.values())], check=True)
    for job in jobs.values():  # gone before the next test uses the cluster
        assert sacct_job(job["job_id"], timeout=60, final=True)["State"].startswith("CANCELLED")


def test_an_account_slurm_refuses_is_one_line_and_queues_nothing(slurm_cluster, tmp_path):
    profile = tmp_path / "cluster.yaml"
    profile.write_text("partition: debug\naccount: no-such-account\n")
    run_dir = tmp_path / "refused"
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "1", "--platform", "cpu",
           "--cluster-config", str(profile), "--out", str(run_dir), "--set", "data.source=synthetic"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 1
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("megatron-hpc: error:")]
    assert line.startswith("megatron-hpc: error: sbatch refused the run phase: Batch job submission failed: "
                           "Invalid account"), proc.stderr
    assert f"(script: {run_dir / 'run.sbatch'})" in line
    # nothing of this run folder in the queue (jobs other tests left are theirs, not this submit's)
    queued = subprocess.run(["squeue", "-h", "-o", "%i %j %o"], capture_output=True, text=True, check=True)
    assert [line for line in queued.stdout.splitlines() if str(run_dir) in line] == [], queued.stdout


def test_a_failed_run_phase_names_the_workers_error(slurm_cluster, tmp_path):
    """Not torchrun's ChildFailedError: the trainer's one-line error, and no requeue for what a retry cannot fix.

    The planner refuses bad values before anything is queued, so the failure here is one only the job meets:
    checkpoint.load names a folder whose tracker points at a checkpoint that is not there.
    """
    profile = tmp_path / "cluster.yaml"
    profile.write_text("partition: debug\nmax_requeues: 1\n")  # a requeue, if any, stays short
    broken = tmp_path / "broken-ckpt"
    broken.mkdir()
    (broken / "latest_checkpointed_iteration.txt").write_text("5")
    run_dir = tmp_path / "bad-load"
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "1", "--platform", "cpu",
           "--cluster-config", str(profile), "--wait", "--json", "--out", str(run_dir),
           "--set", "data.source=synthetic", "--set", "train.num_steps=2", "--set", f"checkpoint.load={broken}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S, env=_env())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    reason = json.loads(proc.stdout)["reason"]
    assert reason.startswith("run phase (job "), reason
    assert "ChildFailedError" not in reason
    assert "iter_0000005" in reason and "missing or incomplete" in reason, reason
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(a["phase"], a["action"], a["requeued"]) for a in attempts] == [("run", "fail", False)], attempts
    assert "a retry would fail the same way" in attempts[-1]["message"] or "not requeued" in attempts[-1]["message"]


def test_pipeline_across_two_nodes_trains_as_data_parallel_does(slurm_cluster, sacct_job, tmp_path, demo_data):
    # One worker per node: PP 2 puts one stage on each node (the planner's layout: PP across nodes), DP 2 one replica
    # on each. Same seed, same global batch: the same losses, step by step.
    # Both submitted at once (two nodes each of the four): their waits on SLURM and on start-up overlap.
    runs = {name: subprocess.Popen(submit_command(tmp_path / name, demo_data, "--set", f"parallel.pipeline={pipeline}",
                                                  "--set", "launch.workers_per_node=1", "--set", "train.log_interval=1",
                                                  "--set", "train.num_steps=12"),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, pipeline in (("dp2", "1"), ("pp2", "2"))}
    losses = {}
    for name, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=SUBMIT_TIMEOUT_S)
        assert proc.returncode == 0, f"{stdout}\n{stderr}"
        run_dir = tmp_path / name
        assert sacct_job(jobs_by_phase(json.loads(stdout))["run"]["job_id"], final=True)["State"] == "COMPLETED"
        plan = json.loads((run_dir / "plan.json").read_text())
        assert (plan["pipeline_parallel"], plan["data_parallel"]) == ((2, 1) if name == "pp2" else (1, 2))
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [s["lm_loss"] for s in steps if s["phase"] == "run"]
    assert len(losses["pp2"]) == 12
    assert losses["pp2"] == pytest.approx(losses["dp2"], rel=1e-5)
