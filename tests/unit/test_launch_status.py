"""status / logs / runs over run folders written the way submit and the trainer write them."""

import json
import os

import pytest
from megatron_hpc.launch.run_status import find_run_dir, format_status, read_progress, read_status

from megatron_hpc.cli.main import main
from megatron_hpc.errors import LaunchError


def make_run(tmp_path, *, name="tiny/20260101-000000", cluster="local", steps=(10, 20), num_steps=100,
             jobs=(("compile", "11", "COMPLETED"), ("run", "12", "COMPLETED"))):
    run_dir = tmp_path / "runs" / name
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(run_dir),
                 "--set", f"train.num_steps={num_steps}"]) == 0
    (run_dir / "submission.json").write_text(json.dumps({
        "cluster": cluster, "ok": True, "reason": "",
        "jobs": [{"phase": p, "job_id": j, "state": s, "depends_on": None} for p, j, s in jobs]}))
    with (run_dir / "metrics.jsonl").open("w") as fh:
        for i, it in enumerate(steps):
            fh.write(json.dumps({"iteration": it, "phase": "run", "lm_loss": 5.0 - i, "elapsed_ms": 500.0,
                                 "tokens_per_s": 2048.0}) + "\n")
    return run_dir


def test_progress_and_eta_from_the_last_logged_step(tmp_path):
    run_dir = make_run(tmp_path, steps=(10, 20, 30))
    progress = read_progress(run_dir, train_iters=100)
    assert (progress.iteration, progress.train_iters, progress.lm_loss) == (30, 100, 3.0)
    assert progress.eta_s == pytest.approx(70 * 0.5)


def test_an_ended_run_shows_no_eta(tmp_path):
    """A run cancelled at iteration 20 of 100 is not 40 s from its end (status printed an ETA after cancel)."""
    cancelled = make_run(tmp_path, name="tiny/c", jobs=(("run", "12", "CANCELLED"),))
    status = read_status(cancelled)
    assert status.progress.iteration == 20 and status.progress.eta_s is None
    assert "ETA" not in format_status(status)
    running = make_run(tmp_path, name="tiny/r", jobs=(("run", "13", "RUNNING"),))
    assert read_status(running).progress.eta_s == pytest.approx(80 * 0.5)


def test_validation_rows_do_not_hide_training_progress(tmp_path):
    run_dir = make_run(tmp_path, steps=(10, 20))
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"iteration": 20, "phase": "valid", "lm_loss": 9.0, "lm_loss_ppl": 8103.0}) + "\n")
    progress = read_progress(run_dir, train_iters=100)
    assert (progress.phase, progress.iteration, progress.lm_loss) == ("run", 20, 4.0)


def test_partial_last_line_is_ignored(tmp_path):
    run_dir = make_run(tmp_path, steps=(10, 20))
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('{"iteration": 30, "pha')  # the trainer is appending right now
    assert read_progress(run_dir, train_iters=100).iteration == 20


def test_status_by_folder_job_id_and_latest(tmp_path, monkeypatch, capsys):
    older = make_run(tmp_path, name="tiny/a", jobs=(("run", "5", "COMPLETED"),))
    newer = make_run(tmp_path, name="tiny/b", jobs=(("run", "7", "FAILED"),))
    monkeypatch.chdir(tmp_path)
    assert find_run_dir("5") == older.resolve()
    assert find_run_dir(str(newer)) == newer.resolve()
    os.utime(older / "submission.json", (1, 1))
    assert find_run_dir(None) == newer.resolve()
    with pytest.raises(LaunchError, match=r"neither a run folder nor a job id.*; pass the run folder submit printed"):
        find_run_dir("999")
    capsys.readouterr()
    assert main(["status", "--json", "7"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["jobs"] == [{"phase": "run", "job_id": "7", "state": "FAILED", "nodes": "", "restarts": 0,
                             "source": "submit"}]
    assert data["progress"]["iteration"] == 20


def test_slurm_state_falls_back_to_the_submit_record(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path, cluster="slurm", jobs=(("run", "42", "SUBMITTED"),))
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    status = read_status(run_dir)
    assert status.jobs[0].state == "SUBMITTED"
    assert "did not answer" in status.jobs[0].source


def test_logs_picks_the_last_node_of_the_latest_phase(tmp_path, capsys):
    run_dir = make_run(tmp_path)
    for phase, node, text in (("compile", 0, "c0\n"), ("run", 0, "r0\n"), ("run", 1, "r1\n"), ("run", 10, "r10\n")):
        (run_dir / "logs" / f"{phase}-node{node}.log").write_text(text)
    capsys.readouterr()
    assert main(["logs", str(run_dir)]) == 0
    assert capsys.readouterr().out == "r10\n"  # numeric order: node 10 is the last
    assert main(["logs", str(run_dir), "--phase", "compile", "--node", "0"]) == 0
    assert capsys.readouterr().out == "c0\n"
    assert main(["logs", str(run_dir), "--node", "3"]) == 1
    assert "nodes with logs: 0, 1, 10" in capsys.readouterr().err


def test_runs_table(tmp_path, monkeypatch, capsys):
    make_run(tmp_path, name="tiny/x", steps=(10, 20, 30))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["runs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["run", "nodes"]
    assert out[1].split()[0] == "tiny/x" and "30/100" in out[1]


def test_cancel_refuses_a_local_run(tmp_path, capsys):
    run_dir = make_run(tmp_path)
    capsys.readouterr()
    assert main(["cancel", str(run_dir)]) == 1
    assert "Ctrl-C" in capsys.readouterr().err


def test_cancel_of_a_dry_run_folder_says_it_was_never_submitted(tmp_path, capsys):
    # A dry run writes no submission.json: it was not a local run, and Ctrl-C is no advice for it.
    run_dir = tmp_path / "dry"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["cancel", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert "was never submitted" in err and "nothing to cancel" in err and "Ctrl-C" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_without_slurm_answers_the_state_comes_from_the_node_scripts_record(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path, cluster="slurm", jobs=(("run", "42", "SUBMITTED"),))
    # what the node script appended: a requeue after an early stop, then the resumed attempt finishing
    rows = [{"phase": "run", "job_id": "42", "attempt": 0, "action": "requeue", "exit_code": 0},
            {"phase": "run", "job_id": "42", "attempt": 1, "action": "done", "exit_code": 0},
            {"phase": "run", "job_id": "41", "attempt": 0, "action": "fail", "exit_code": 1}]
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"partial')
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    (job,) = read_status(run_dir).jobs
    assert (job.state, job.restarts) == ("COMPLETED", 1)
    assert job.source.startswith("logs")


def test_last_checkpoint_is_the_one_the_tracker_names(tmp_path, capsys):
    run_dir = make_run(tmp_path)
    ckpts = run_dir / "checkpoints"
    (ckpts / "iter_0000010").mkdir(parents=True)
    (ckpts / "iter_0000020.tmp-abc").mkdir()  # a save in progress is not a checkpoint
    assert read_status(run_dir).last_checkpoint is None  # no tracker yet
    (ckpts / "latest_checkpointed_iteration.txt").write_text("10")
    assert read_status(run_dir).last_checkpoint == str(ckpts / "iter_0000010")
    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 0
    assert f"checkpoint {ckpts / 'iter_0000010'}" in capsys.readouterr().out


def test_the_nodes_named_as_stragglers_are_in_status_and_its_json(tmp_path, capsys):
    run_dir = make_run(tmp_path)
    before = read_status(run_dir)  # before the trainer's first log
    assert (before.stragglers, before.straggler_check) == ([], None)
    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 0
    assert "stragglers" not in capsys.readouterr().out
    record = {"updated_at": 1.0, "iteration": 20, "threshold": 1.2, "window": 3, "median_compute_s": 0.5,
              "nodes": [{"node": "gpu-7", "ranks": [56, 57], "compute_s": 0.8, "wait_s": 0.01, "ratio": 1.6}]}
    (run_dir / "stragglers.json").write_text(json.dumps(record))
    assert main(["status", "--json", str(run_dir)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["stragglers"] == record["nodes"]
    assert shown["straggler_check"] == {k: v for k, v in record.items() if k != "nodes"}
    assert main(["status", str(run_dir)]) == 0
    assert "stragglers gpu-7 1.60x the median node" in capsys.readouterr().out


def test_a_run_made_with_out_runs_name_is_found_by_runs_and_status(tmp_path, monkeypatch, capsys):
    """`submit --out runs/NAME` puts the run one level up from runs/<recipe>/<stamp>/: `runs` listed nothing and
    `status` (no argument) said there were no runs."""
    make_run(tmp_path, name="tiny/x", steps=(10,))
    named = make_run(tmp_path, name="mine", steps=(10, 20, 40))
    os.utime(named / "submission.json")  # the newest
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["runs"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == ["mine", "tiny/x"]
    assert find_run_dir(None) == named.resolve()
