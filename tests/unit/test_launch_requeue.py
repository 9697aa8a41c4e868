"""What happens to a SLURM job after its phase ended on a node (launch/requeue.py decide)."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from megatron_hpc.launch.requeue import Outcome, decide, read_outcome

from megatron_hpc.run_markers import (
    FATAL_FILE,
    STOPPED_FILE,
    FatalMarker,
    StoppedMarker,
    read_marker,
    write_marker,
)

STOPPED = StoppedMarker(iteration=40, reason="signal SIGUSR2", checkpoint="/runs/x/checkpoints/iter_0000040")


def outcome(**kw) -> Outcome:
    base = dict(phase="run", exit_code=0, node_rank=0, attempt=0, max_requeues=3, on_slurm=True)
    return Outcome(**{**base, **kw})


def test_a_finished_phase_is_done():
    assert decide(outcome()).action == "done"
    assert decide(outcome(phase="compile")).action == "done"


def test_an_early_stop_is_requeued_by_node_0_only():
    first = decide(outcome(stopped=STOPPED))
    assert first.action == "requeue"
    assert "iteration 40" in first.message and "requeue 1 of 3" in first.message
    other = decide(outcome(stopped=STOPPED, node_rank=1))
    assert other.action == "done"


def test_an_early_stop_counts_against_the_requeue_limit():
    assert decide(outcome(stopped=STOPPED, attempt=2)).action == "requeue"
    last = decide(outcome(stopped=STOPPED, attempt=3))
    assert last.action == "fail"
    assert "limit of 3" in last.message and "--resume" in last.message


def test_an_early_stop_outside_slurm_says_how_to_continue():
    d = decide(outcome(stopped=STOPPED, on_slurm=False))
    assert d.action == "fail" and "submit --resume" in d.message


def test_a_crash_of_the_run_phase_is_requeued_but_not_our_own_errors():
    assert decide(outcome(exit_code=1)).action == "requeue"
    marker = FatalMarker(phase="run", kind="DataError", error="missing file\nsecond line")
    fatal = decide(outcome(exit_code=1, fatal=marker))
    assert fatal.action == "fail"
    assert fatal.message == ("run phase failed (exit 1): DataError: missing file; not requeued, a retry would fail "
                             "the same way")
    assert decide(outcome(exit_code=137, attempt=3)).action == "fail"


def test_the_requeue_limit_names_the_settings_that_exist():
    last = decide(outcome(exit_code=1, attempt=3))
    assert last.action == "fail"
    assert last.message == ("run phase failed (exit 1); not requeued: requeue limit of 3 reached (raise max_requeues "
                            "in the cluster profile, or set MEGATRON_HPC_MAX_REQUEUES where you submit; default 3)")


def test_a_failed_compile_is_never_requeued():
    # the run job depends on it (afterok) and SLURM cancels it; retrying would hide the failure
    assert decide(outcome(phase="compile", exit_code=1)).action == "fail"


def test_markers_from_another_attempt_are_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_marker(tmp_path, STOPPED_FILE, {"iteration": 12})
    assert read_marker(tmp_path, STOPPED_FILE)["iteration"] == 12
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # the requeued attempt must not requeue again on it
    assert read_marker(tmp_path, STOPPED_FILE) is None
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert read_marker(tmp_path, STOPPED_FILE) is None


def test_read_outcome_takes_the_limit_and_node_from_the_environment(tmp_path):
    env = {"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "2", "SLURM_NODEID": "3", "MEGATRON_HPC_MAX_REQUEUES": "7"}
    (tmp_path / FATAL_FILE).write_text(json.dumps({"job_id": "5", "attempt": 2, "kind": "ConfigError"}))
    o = read_outcome(tmp_path, phase="run", exit_code=1, environ=env)
    assert (o.attempt, o.node_rank, o.max_requeues, o.on_slurm) == (2, 3, 7, True)
    assert o.fatal == FatalMarker(phase="?", kind="ConfigError", error="")
    assert o.stopped is None


@pytest.mark.parametrize("code", [0, 3])
def test_the_cli_outside_slurm_passes_the_phase_exit_code_through(tmp_path, code):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-m", "megatron_hpc.launch.requeue", "--run-dir", str(tmp_path),
                           "--phase", "run", "--exit-code", str(code)], env=env, capture_output=True, text=True)
    assert proc.returncode == code
    assert json.loads((tmp_path / "attempts.jsonl").read_text().splitlines()[-1])["exit_code"] == code


SCONTROL_STAND_IN = """#!/bin/sh
# A stand-in for scontrol, named as one: `scontrol requeue` on a real cluster has SLURM send SIGTERM to
# every process of the job at once, the caller included; this one does that to its caller, then answers.
case "$1" in
  show) echo "JobId=123 JobState=RUNNING Restarts=0" ;;
  requeue) kill -TERM "$PPID"; sleep 0.5 ;;
esac
"""


def _job_with_scontrol_stand_in(tmp_path) -> tuple:
    """A run folder and the environment of node 0's task in job 123's first attempt, scontrol the stand-in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(SCONTROL_STAND_IN)
    (bin_dir / "scontrol").chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "123", "SLURM_RESTART_COUNT": "0"}
    return run_dir, env


def _node_0_failed_run(run_dir) -> list[str]:
    """The command node.sh runs on node 0 after a run phase that failed with exit 1."""
    return [sys.executable, "-m", "megatron_hpc.launch.requeue", "--run-dir", str(run_dir), "--phase", "run",
            "--exit-code", "1", "--node-rank", "0"]


def test_the_requeue_sigterm_does_not_cut_the_attempt_record(tmp_path):
    # CI once lost attempt 0's row: SLURM's SIGTERM of the requeue killed the node task before it appended it.
    run_dir, env = _job_with_scontrol_stand_in(tmp_path)
    proc = subprocess.run(_node_0_failed_run(run_dir), env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "requeueing to resume" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["action"], r["requeued"]) for r in rows] == [(0, "requeue", True)]


def _open_fifo_for_writing(path, proc, *, timeout_s: float = 60.0) -> int:
    """The writing end once `proc` opened the FIFO to read (it then waits for what is written); never hangs."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO or proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the node task never opened {path}: {proc.communicate()}") from exc
            time.sleep(0.05)


def test_another_nodes_requeue_while_node_0_reads_the_markers_does_not_cut_its_record(tmp_path):
    # On a failed run every failing node requeues, and whichever gets there first has SLURM send SIGTERM to every
    # process of the job: node 0's task may still be reading this attempt's markers. Here stopped.json is a FIFO,
    # so the task is held in the middle of that read while the SIGTERM arrives; then it reads on.
    run_dir, env = _job_with_scontrol_stand_in(tmp_path)
    os.mkfifo(run_dir / STOPPED_FILE)
    proc = subprocess.Popen(_node_0_failed_run(run_dir), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    fd = _open_fifo_for_writing(run_dir / STOPPED_FILE, proc)
    proc.send_signal(signal.SIGTERM)  # another node's requeue
    os.close(fd)  # an empty file: no stopped.json of this attempt
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (proc.returncode, err)
    assert "requeueing to resume" in out
    rows = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["action"], r["exit_code"]) for r in rows] == [(0, "requeue", 1)]
