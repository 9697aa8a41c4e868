"""Hot spares on the real local SLURM cluster: a step that fails restarts in the same job on the spare.

Two-node `tiny` runs with one spare (three nodes held, `--no-kill`), synthetic data, no compile phase. A node made
DOWN, a worker killed with SIGKILL, and `megatron-hpc restart --exclude` in the middle of a run must each end
with the same job id COMPLETED, never requeued, one line in restarts.jsonl, the trainer resumed from a
checkpoint, and final weights (and optimizer state) equal to those of a two-node run that was never interrupted.
The run without spares that loses a node is requeued as before: test_requeue_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import tiny_runs
from tiny_runs import clean_env as _env
from tiny_runs import job_fields, submit_tiny

pytestmark = pytest.mark.slurm

NUM_STEPS = 16
SETS = ["data.source=synthetic", f"train.num_steps={NUM_STEPS}", "train.log_interval=1", "compile.enabled=false",
        "checkpoint.save_interval=4", "train.tensorboard=false", "launch.exclusive=true"]
RUN_TIMEOUT_S = 300
NODE_BACK_TIMEOUT_S = 300
"""How long a node set DOWN may take to come back idle: its slurmd is busy tearing a step down and the controller
pings it on its own schedule, each slower on a loaded machine. Polled: a node back at once returns at once."""


def submit(run_dir: Path, *, spares: int, extra: Sequence[str] = ()) -> str:
    return submit_tiny(run_dir, [*SETS, f"launch.spare_nodes={spares}", *extra])


def driver_log(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.out")))


def first_step_nodes(run_dir: Path, timeout: float = RUN_TIMEOUT_S) -> list[str]:
    # Long enough for the job to wait in the queue: a node an earlier test or the benchmark's smoke run made DOWN
    # may still be coming back, and a run with two spares needs all four.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in driver_log(run_dir).splitlines():
            if line.startswith("megatron-hpc: in-job: step 0 on "):
                return line.rsplit(" ", 1)[1].split(",")
        time.sleep(0.2)
    nodes = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %T %E"], capture_output=True, text=True).stdout
    queue = subprocess.run(["squeue", "-h", "-o", "%i %T %R"], capture_output=True, text=True).stdout
    raise AssertionError(f"the driver never started step 0:\n{driver_log(run_dir)[-2000:]}\nnodes:\n{nodes}"
                         f"queue:\n{queue}")


def wait_for_iteration(run_dir: Path, iteration: int, timeout: float = RUN_TIMEOUT_S) -> None:
    tiny_runs.wait_for_iteration(run_dir, iteration, timeout)


def final_tensors(run_dir: Path) -> dict[str, object]:
    from megatron_hpc.checkpoint.conversion import read_whole
    from megatron_hpc.checkpoint.store import iter_tensors

    whole = read_whole(run_dir / "checkpoints")
    assert whole.found.iteration == NUM_STEPS
    return dict(iter_tensors(whole.grid[0][0]))


def wait_job_end(job_id: str, timeout: float = RUN_TIMEOUT_S) -> str:
    """The job's final state from the controller (sacct shows a job that lost a node under --no-kill as
    RESIZING: SLURM accounts the shrunken job as a new record)."""
    deadline = time.monotonic() + timeout
    while (state := job_fields(job_id).get("JobState")) in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job_id} is still {state} after {timeout} s"
        time.sleep(0.5)
    return state or "?"


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> Path:
    """A two-node run without spares that nothing interrupts."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert wait_job_end(submit(run_dir, spares=0)) == "COMPLETED"
    return run_dir


def check_restarted_on_the_spare(run_dir: Path, job_id: str, reference: Path, *, reason: str, lost: str) -> dict:
    """The job finished on the spare without a requeue and equals the reference; returns the restart line."""
    import torch

    assert wait_job_end(job_id) == "COMPLETED", driver_log(run_dir)[-3000:]
    assert job_fields(job_id)["Restarts"] == "0", driver_log(run_dir)[-3000:]  # never left the allocation
    records = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    (line,) = [x for x in records if "reason" in x]
    (done_at,) = [x["first_step_done_at"] for x in records if "first_step_done_at" in x]
    assert (line["reason"], line["nodes_lost"], line["step"]) == (reason, [lost], 1)
    assert lost not in line["nodes"] and len(line["nodes"]) == 2
    node0 = (run_dir / "logs" / "run-node0.log").read_text(errors="replace")
    (loaded,) = [x for x in node0.splitlines() if "> loaded checkpoint" in x]
    assert 0 < int(loaded.split("at iteration ")[1].split()[0]) < NUM_STEPS
    want, got = final_tensors(reference), final_tensors(run_dir)
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name
    status = json.loads(subprocess.run([sys.executable, "-m", "megatron_hpc", "status", str(run_dir), "--json"],
                                       capture_output=True, text=True, env=_env(), check=True).stdout)
    (restart,) = status["restarts"]
    assert status["nodes_lost"] == [lost] and status["spare_nodes"] == 1
    # The cost status reports is the records' span, from the failure to the new step's first logged step; how long
    # that takes is benchmarks/in_job_restart.py's business (a loaded machine stretches it), not a bound here.
    assert restart["cost_s"] == pytest.approx(done_at - line["failed_at"]) and restart["cost_s"] > 0
    return line


def _return_to_service(node: str) -> None:
    deadline = time.monotonic() + NODE_BACK_TIMEOUT_S
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout.strip()
        if state in ("idle", "mix", "alloc"):
            return
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        time.sleep(1)
    raise AssertionError(f"{node} did not come back: {state}")


# First of the module: it holds all four nodes, and a node that a requeue or a kill just released can stay out of
# the scheduler's reach for a while on a loaded machine (one whole-tier run waited 80 s for it after the requeue
# tests); the tests after it need three.
def test_exclude_stragglers_leaves_the_named_node_out_of_the_restart(reference, tmp_path, worker_pids):
    """Two spares: a killed worker takes its node out, and stragglers.json (written here as the trainer's last rank
    writes it) takes out the slow one too, while two healthy nodes remain."""
    run_dir = tmp_path / "straggler"
    job_id = submit(run_dir, spares=2, extra=["launch.exclude_stragglers=true"])
    first, second = first_step_nodes(run_dir)
    wait_for_iteration(run_dir, 6)
    # Rank 1, the last rank, rewrites stragglers.json at a gather that names or stops naming a node (a busy machine
    # makes one slow now and then): stopped, it cannot overwrite the file between this write and its kill (the
    # lookup of its pid alone takes a /proc scan, as long as a step on a loaded machine).
    pid = worker_pids(run_dir)[1]
    os.kill(pid, signal.SIGSTOP)
    (run_dir / "stragglers.json").write_text(json.dumps({"nodes": [{"node": first, "ratio": 1.6}]}))
    os.kill(pid, 9)
    assert wait_job_end(job_id) == "COMPLETED", driver_log(run_dir)[-3000:]
    (line,) = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines() if '"reason"' in x]
    assert line["nodes_lost"] == [second] and first not in line["nodes"] and second not in line["nodes"]
    assert f"leaving out the straggler(s) {first} (launch.exclude_stragglers)" in driver_log(run_dir)
    # (the new step's trainer rewrote stragglers.json at its first timed log: it names no one now)


def test_a_node_down_mid_run_restarts_on_the_spare(reference, tmp_path):
    run_dir = tmp_path / "down"
    job_id = submit(run_dir, spares=1)
    lost = first_step_nodes(run_dir)[1]  # not the first node: the batch script (the driver) runs there
    wait_for_iteration(run_dir, 6)  # past the save at 4
    try:
        subprocess.run(["scontrol", "update", f"nodename={lost}", "state=down", "reason=in-job test"], check=True)
        line = check_restarted_on_the_spare(run_dir, job_id, reference, reason="node_lost", lost=lost)
    finally:
        _return_to_service(lost)
    assert line["failed_at"] <= line["detected_at"] <= line["new_step_started_at"]


def test_a_worker_killed_mid_run_restarts_on_the_spare(reference, tmp_path, worker_pids):
    run_dir = tmp_path / "killed"
    job_id = submit(run_dir, spares=1)
    lost = first_step_nodes(run_dir)[1]  # node rank 1 holds rank 1
    wait_for_iteration(run_dir, 6)
    os.kill(worker_pids(run_dir)[1], 9)
    check_restarted_on_the_spare(run_dir, job_id, reference, reason="rank_failed", lost=lost)


def test_restart_exclude_moves_a_running_job_off_a_node(reference, tmp_path, cli_in_process):
    run_dir = tmp_path / "moved"
    job_id = submit(run_dir, spares=1)
    moved = first_step_nodes(run_dir)[0]
    held = job_fields(job_id)["NodeList"]
    wait_for_iteration(run_dir, 6)
    outside = next(f"node{i}" for i in range(1, 5) if f"node{i}" not in
                   subprocess.run(["scontrol", "show", "hostnames", held], capture_output=True, text=True).stdout)
    refused = cli_in_process("restart", str(run_dir), "--exclude", outside)
    assert refused.returncode == 1 and f"{outside} not in job {job_id}'s allocation" in refused.stderr
    assert not (run_dir / "restart-request.json").exists()
    asked = cli_in_process("restart", str(run_dir), "--exclude", moved)
    assert asked.returncode == 0, asked.stderr
    check_restarted_on_the_spare(run_dir, job_id, reference, reason="requested", lost=moved)
    node0 = (run_dir / "logs" / "run-node0.log").read_text(errors="replace")
    assert re.search(r"> stopping at iteration \d+ on stop request", node0), node0[-3000:]
    finished = cli_in_process("restart", str(run_dir), "--exclude", moved)
    assert finished.returncode == 1 and "is not running" in finished.stderr


def requeued_once_then_completed(job_id: str, run_dir: Path) -> list[dict]:
    """Waits until the job was requeued once (the same job id runs again) and completed; its two attempts, the
    first a requeue and the second done, are returned."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while job_fields(job_id).get("Restarts") != "1":  # requeued: the same job id runs again
        assert time.monotonic() < deadline, driver_log(run_dir)[-3000:]
        time.sleep(0.5)
    assert wait_job_end(job_id) == "COMPLETED", driver_log(run_dir)[-3000:]
    attempts = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["action"], a["requeued"]) for a in attempts] == [(0, "requeue", True), (1, "done", False)]
    return attempts


def test_with_no_restart_left_the_job_is_requeued_as_without_spares(reference, tmp_path, worker_pids):
    import torch

    run_dir = tmp_path / "bounded"
    job_id = submit(run_dir, spares=1, extra=["launch.max_in_job_restarts=0"])
    wait_for_iteration(run_dir, 6)
    os.kill(worker_pids(run_dir)[1], 9)
    requeued_once_then_completed(job_id, run_dir)
    assert "launch.max_in_job_restarts=0 restarts done in this job: requeueing instead" in driver_log(run_dir)
    assert not (run_dir / "restarts.jsonl").exists()
    want, got = final_tensors(reference), final_tensors(run_dir)
    assert all(torch.equal(tensor, got[name]) for name, tensor in want.items())


def test_the_time_signal_requeues_a_job_with_spares_which_resumes_as_without(reference, tmp_path):
    import torch

    run_dir = tmp_path / "signalled"
    job_id = submit(run_dir, spares=1)
    wait_for_iteration(run_dir, 4)
    # What SLURM does --signal=USR2@90 before the limit: USR2 to every process of the job's steps. The workers save
    # and stop; a stop is not a failure, so the driver hands over to the requeue instead of restarting in the job.
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    attempts = requeued_once_then_completed(job_id, run_dir)
    k = attempts[0]["iteration"]
    node0 = (run_dir / "logs" / "run-node0.log").read_text(errors="replace")
    assert f"> stopping at iteration {k} on signal SIGUSR2" in node0 and 4 <= k < NUM_STEPS
    (loaded,) = [x for x in node0.splitlines() if "> loaded checkpoint" in x]
    assert f"at iteration {k} " in loaded + " "  # resumed where the signal stopped it
    assert not (run_dir / "restarts.jsonl").exists()  # no in-job restart on the way
    want, got = final_tensors(reference), final_tensors(run_dir)
    assert all(torch.equal(tensor, got[name]) for name, tensor in want.items())


def test_debug_dumps_the_running_steps_nodes_not_the_spare(slurm_cluster, tmp_path, cli_in_process):
    run_dir = tmp_path / "debugged"
    job_id = submit(run_dir, spares=1, extra=["train.num_steps=100000"])
    moved = first_step_nodes(run_dir)[0]
    wait_for_iteration(run_dir, 3)
    # An in-job restart first: the new step runs on the spare and the other node, not on the allocation's first two.
    asked = cli_in_process("restart", str(run_dir), "--exclude", moved)
    assert asked.returncode == 0, asked.stderr
    deadline, lines = time.monotonic() + RUN_TIMEOUT_S, []
    while not any("first_step_done_at" in line for line in lines):
        assert time.monotonic() < deadline, driver_log(run_dir)[-3000:]
        time.sleep(0.5)
        restarts = run_dir / "restarts.jsonl"
        lines = restarts.read_text().splitlines() if restarts.exists() else []
    (restart,) = [json.loads(x) for x in lines if '"reason"' in x]
    step_nodes = restart["nodes"]
    assert moved not in step_nodes
    debug = cli_in_process("debug", str(run_dir), "--json", "--method", "signal")
    assert debug.returncode == 0, debug.stdout + debug.stderr
    report = json.loads(debug.stdout)
    assert report["job_id"] == job_id and report["missing"] == [] and report["world_size"] == 2
    subprocess.run(["scancel", job_id], check=True)
    # One machine stands for every node here, so the stacks' host names cannot say where the dump ran; SLURM's
    # accounting of the debug step can.
    deadline, debug_nodes = time.monotonic() + 60, ""
    while not debug_nodes:
        assert time.monotonic() < deadline, "no megatron-hpc-debug step in the job's accounting"
        out = subprocess.run(["sacct", "-j", job_id, "-n", "-P", "--format=JobName,NodeList"], capture_output=True,
                             text=True).stdout
        debug_nodes = next((line.split("|")[1] for line in out.splitlines() if line.startswith("megatron-hpc-debug|")),
                           "")
        time.sleep(0.5)
    held = subprocess.run(["scontrol", "show", "hostnames", debug_nodes], capture_output=True, text=True).stdout
    assert sorted(held.split()) == sorted(step_nodes)


def test_spares_beyond_the_partition_are_refused_before_anything_is_queued(slurm_cluster, tmp_path):
    cmd = [sys.executable, "-m", "megatron_hpc", "submit", "--recipe", "tiny", "--nodes", "2", "--platform", "cpu",
           "--cluster", "slurm", "--partition", "debug", "--out", str(tmp_path / "run"),
           "--set", "data.source=synthetic", "--set", "compile.enabled=false", "--set", "launch.spare_nodes=3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "megatron-hpc: error: --nodes 2 + launch.spare_nodes=3 asks for 5 nodes, but partition debug has 4; use "
        "--set launch.spare_nodes=2, or a larger --partition")
    assert not (tmp_path / "run").exists()  # refused before the run folder is made: nothing is left behind


def test_a_stopped_rank_is_caught_as_a_hang_and_restarted_on_the_spare(reference, tmp_path, worker_pids):
    """SIGSTOP: the node watchdog (launch/watchdog.py) reports the hang naming the node, kills its workers, and the
    driver restarts without that node."""
    run_dir = tmp_path / "stopped"
    job_id = submit(run_dir, spares=1, extra=["launch.hang_timeout_s=10"])
    lost = first_step_nodes(run_dir)[1]
    wait_for_iteration(run_dir, 6)
    os.kill(worker_pids(run_dir)[1], signal.SIGSTOP)
    line = check_restarted_on_the_spare(run_dir, job_id, reference, reason="hang", lost=lost)
    # The stopped rank's node names it; another node's watchdog may fire too before srun ends the step, and it
    # blames no healthy node (its own ranks wait in a collective; it cannot see the stopped one's state: none named).
    reports = [json.loads(p.read_text()) for p in (run_dir / "hangs").glob("*.json")]
    assert any(r["suspect_nodes"] == [lost] for r in reports), reports
    assert all(set(r["suspect_nodes"]) <= {lost} for r in reports), reports
    assert line["failed_at"] == min(r["detected_at"] for r in reports)
    assert list((run_dir / "debug").glob("hang-*.txt"))  # the stacks, saved before the workers were killed
