"""`submit --resume` refusals and the submit-time environment checks."""

import json

import pytest
from megatron_hpc.launch import env_checks
from megatron_hpc.launch.submit import SubmitRequest, run_local

from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.plan.jobs import PhaseSpec
from megatron_hpc.plan.planner import make_plan
from megatron_hpc.run_folder import NODE_SCRIPT, node_log

MOUNTS = """\
sysfs /sys sysfs rw 0 0
/dev/vda1 / ext4 rw 0 0
tmpfs /scratch tmpfs rw 0 0
fs1:/home /shared nfs4 rw 0 0
"""


def test_slurm_variables_from_an_allocation_are_named_and_removed():
    env = {"SLURM_JOB_ID": "5", "SLURM_CPU_BIND": "cores", "SBATCH_PARTITION": "x", "SLURM_CONF": "/etc/s.conf",
           "HOME": "/root"}
    warnings = env_checks.submit_warnings(env, run_dir=env_checks.Path("/shared/r"), cluster="slurm", num_nodes=2,
                                          nofile_limit=100, hard_nofile=100, mounts=MOUNTS)
    assert len(warnings) == 1 and "SBATCH_PARTITION, SLURM_CPU_BIND, SLURM_JOB_ID" in warnings[0]
    assert env_checks.remove_slurm_vars(env) == ["SBATCH_PARTITION", "SLURM_CPU_BIND", "SLURM_JOB_ID"]
    assert env == {"SLURM_CONF": "/etc/s.conf", "HOME": "/root"}


@pytest.mark.parametrize(("path", "local"), [("/tmp/runs/a", True), ("/dev/shm/x", True), ("/scratch/run", True),
                                             ("/shared/runs/a", False), ("/home/u/runs", False)])
def test_node_local_run_folders_are_recognised(path, local):
    reason = env_checks.node_local_reason(env_checks.Path(path), MOUNTS)
    assert (reason is not None) == local
    warnings = env_checks.submit_warnings({}, run_dir=env_checks.Path(path), cluster="slurm", num_nodes=4,
                                          nofile_limit=10, hard_nofile=10, mounts=MOUNTS)
    assert any("node-local" in w for w in warnings) == local
    # one node, or this machine: a local folder is fine
    assert env_checks.submit_warnings({}, run_dir=env_checks.Path(path), cluster="slurm", num_nodes=1,
                                      nofile_limit=10, hard_nofile=10, mounts=MOUNTS) == []


def test_a_low_hard_nofile_limit_is_a_warning_for_slurm_runs():
    warnings = env_checks.submit_warnings({}, run_dir=env_checks.Path("/shared/r"), cluster="slurm", num_nodes=1,
                                          nofile_limit=65535, hard_nofile=4096, mounts=MOUNTS)
    assert len(warnings) == 1 and "4096" in warnings[0] and "65535" in warnings[0]


def _finished_run(tmp_path, capsys) -> str:
    run = tmp_path / "run"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(run)]) == 0
    (run / "submission.json").write_text(json.dumps({"cluster": "local", "ok": True, "reason": "", "jobs": [
        {"phase": "run", "job_id": "7", "state": "COMPLETED", "depends_on": None}]}))
    capsys.readouterr()
    return str(run)


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "model.hidden_size=512"], "cannot change on --resume"),
    (["--set", "train.global_batch_size=16"], "cannot change on --resume"),
    (["--recipe", "tiny"], "drop --recipe"),
    (["--nodes", "2"], "keeps it"),
])
def test_resume_refuses_what_would_make_another_run(tmp_path, capsys, args, message):
    run = _finished_run(tmp_path, capsys)
    assert main(["submit", "--resume", run, "--dry-run", *args]) == 1
    assert message in capsys.readouterr().err


def test_resume_of_a_missing_or_running_run_is_refused(tmp_path, capsys):
    assert main(["submit", "--resume", str(tmp_path / "nope"), "--dry-run"]) == 1
    assert "neither a run folder nor a job id" in capsys.readouterr().err
    run = _finished_run(tmp_path, capsys)
    (tmp_path / "run" / "submission.json").write_text(json.dumps({"cluster": "local", "jobs": [
        {"phase": "run", "job_id": "7", "state": "RUNNING", "depends_on": None}]}))
    assert main(["submit", "--resume", run, "--dry-run"]) == 1
    assert "still active" in capsys.readouterr().err


def test_resume_keeps_the_stored_config_and_takes_more_steps(tmp_path, capsys):
    run = _finished_run(tmp_path, capsys)
    before = json.loads((tmp_path / "run" / "config.json").read_text())
    assert main(["submit", "--resume", run, "--dry-run", "--json", "--set", "train.num_steps=250"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run_dir"] == run
    after = json.loads((tmp_path / "run" / "config.json").read_text())
    assert after["train"]["num_steps"] == 250
    # More steps must not stretch the LR schedule under the steps already taken: the horizon is pinned.
    assert before["optim"]["lr_decay_iters"] is None
    assert after["optim"]["lr_decay_iters"] == before["train"]["num_steps"]
    assert out["plan"]["lr_decay"] == before["train"]["num_steps"]
    assert any(f"decay horizon of {before['train']['num_steps']} iterations" in note for note in out["resume"])
    after["train"]["num_steps"] = before["train"]["num_steps"]
    after["optim"]["lr_decay_iters"] = None
    assert after == before


def test_resume_with_an_explicit_horizon_takes_it(tmp_path, capsys):
    run = _finished_run(tmp_path, capsys)
    assert main(["submit", "--resume", run, "--dry-run", "--json", "--set", "train.num_steps=250",
                 "--set", "optim.lr_decay_iters=250"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["lr_decay"] == 250
    assert json.loads((tmp_path / "run" / "config.json").read_text())["optim"]["lr_decay_iters"] == 250


def test_a_hang_timeout_shorter_than_the_runs_measured_steps_is_refused_at_resume(tmp_path, capsys):
    run = _finished_run(tmp_path, capsys)
    rows = [{"iteration": i, "phase": "run", "lm_loss": 5.0, "elapsed_ms": ms, "warmup": i <= 2}
            for i, ms in ((1, 90000.0), (2, 20000.0), (3, 12000.0), (4, 12500.0), (5, 11000.0))]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["submit", "--resume", run, "--dry-run", "--set", "launch.hang_timeout_s=5"]) == 1
    err = capsys.readouterr().err
    assert "launch.hang_timeout_s=5 is shorter than a measured step (12.00 s at iteration 5)" in err
    assert "--set launch.hang_timeout_s=60" in err and len(err.strip().splitlines()) == 1
    # Longer than the steps (the warm-up's 90 s does not count): accepted.
    assert main(["submit", "--resume", run, "--dry-run", "--set", "launch.hang_timeout_s=30"]) == 0


def test_a_resumed_local_run_echoes_only_its_own_attempt(tmp_path):
    # A resumed run appends to logs/run-node0.log; `submit --resume --cluster local` echoed the whole file,
    # replaying the earlier attempt's traceback and "run phase failed" as if this attempt had printed them.
    cfg = load_recipe("tiny", ["data.source=synthetic"])
    platform = get_platform("cpu")
    req = SubmitRequest(cfg=cfg, plan=make_plan(cfg, num_nodes=1, platform=platform), platform=platform,
                        cluster="local", run_dir=tmp_path)
    log = node_log(tmp_path, "run", 0)
    log.parent.mkdir()
    log.write_text("attempt 1: Traceback\nmegatron-hpc: run phase failed (exit 1)\n")
    (tmp_path / NODE_SCRIPT).write_text(f'echo "attempt 2: iteration 5/5" >> "{log}"\n')
    echoed = []
    result = run_local(req, (PhaseSpec(phase="run", job_name="t", num_nodes=1, nproc_per_node=1),), echo=echoed.append)
    assert result.ok
    assert echoed == ["attempt 2: iteration 5/5"]
