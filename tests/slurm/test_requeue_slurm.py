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
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiny_runs
from tiny_runs import job_fields, submit_tiny

pytestmark = pytest.mark.slurm

NUM_STEPS = 24
SETS = ["data.source=synthetic", f"train.num_steps={NUM_STEPS}", "train.log_interval=1", "compile.enabled=false",
        "checkpoint.save_interval=8", "train.tensorboard=false", "launch.exclusive=true"]  # no shared nodes
RUN_TIMEOUT_S = 420


def submit(run_dir: Path) -> str:
    return submit_tiny(run_dir, SETS)


def wait_for_iteration(run_dir: Path, iteration: int, timeout: float = RUN_TIMEOUT_S) -> None:
    tiny_runs.wait_for_iteration(run_dir, iteration, timeout)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in rows if r.get("phase") == "run"}


def requeues(job_id: str) -> int:
    return int(job_fields(job_id).get("Restarts", -1))


def _not_requeued(record: dict[str, str]) -> bool:
    # A lost node ends the attempt as NODE_FAIL for a moment before SLURM queues the job again.
    return record["State"].split()[0] not in ("NODE_FAIL", "PREEMPTED")


def check_resumed(run_dir: Path, straight: tuple[Path, str], job_id: str, sacct_job) -> int:
    """The job ended COMPLETED after one requeue and matches the straight run; returns the resume step."""
    record = sacct_job(job_id, timeout=RUN_TIMEOUT_S, final=True, until=_not_requeued)
    assert sacct_job(straight[1], timeout=RUN_TIMEOUT_S, final=True, until=_not_requeued)["State"] == "COMPLETED"
    node0 = (run_dir / "logs" / "run-node0.log").read_text(errors="replace")
    assert record["State"] == "COMPLETED", node0[-3000:]
    assert requeues(job_id) == 1
    loaded = [line for line in node0.splitlines() if "> loaded checkpoint" in line]
    assert len(loaded) == 1, node0[-3000:]
    k = int(loaded[0].split("at iteration ")[1].split()[0])
    assert 0 < k < NUM_STEPS
    expected, got = losses(straight[0]), losses(run_dir)
    assert max(got) == NUM_STEPS and max(expected) == NUM_STEPS
    for it in range(k + 1, NUM_STEPS + 1):
        assert got[it] == pytest.approx(expected[it], rel=1e-6, abs=0), it
    return k


@pytest.fixture(scope="module")
def straight(slurm_cluster, tmp_path_factory) -> Iterator[tuple[Path, str]]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    job_id = submit(run_dir)
    yield run_dir, job_id
    # ended long before when the tests passed; a test that failed early may leave it running for the next module
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)


def test_warning_signal_saves_requeues_and_resumes(straight, sacct_job, tmp_path):
    run_dir = tmp_path / "signalled"
    job_id = submit(run_dir)
    wait_for_iteration(run_dir, 4)
    # What SLURM does --signal=USR2@90 before the limit: USR2 to every process of the job's steps.
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    k = check_resumed(run_dir, straight, job_id, sacct_job)
    assert k > 4  # it stopped where the signal found it (the log line below says why)
    node0 = (run_dir / "logs" / "run-node0.log").read_text(errors="replace")
    assert f"> stopping at iteration {k} on signal SIGUSR2" in node0
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["action"], a["requeued"], a["iteration"]) for a in attempts] == [
        (0, "requeue", True, k), (1, "done", False, None)]


def test_scontrol_requeue_resumes_from_the_last_checkpoint(straight, sacct_job, tmp_path):
    run_dir = tmp_path / "requeued"
    job_id = submit(run_dir)
    wait_for_iteration(run_dir, 10)  # past the save at 8
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    k = check_resumed(run_dir, straight, job_id, sacct_job)
    assert k >= 8  # the interval save at 8, or the save the workers made on SIGTERM


def _restart_slurmd(node: str, conf_dir: Path) -> None:
    """Start the node's slurmd again, the way slurm/local-cluster-start.sh does, and return it to service."""
    log = conf_dir / "log" / f"slurmd-{node}.out"
    with log.open("a") as fh:
        subprocess.run(["unshare", "--uts", "sh", "-c", f"hostname {node} && exec slurmd -N {node}"],
                       stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, check=True)
    # Polled with room for a loaded machine: the daemon registers with the controller, which then takes the node
    # back on its own schedule (test_in_job_slurm.py's nodes wait as long).
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout
        if state.strip() in ("idle", "mix", "alloc"):
            return
        time.sleep(1)
    raise AssertionError(f"{node} did not come back: {state}")


def test_a_lost_node_requeues_the_job_which_resumes(straight, sacct_job, slurm_cluster, tmp_path):
    run_dir = tmp_path / "lost-node"
    job_id = submit(run_dir)
    wait_for_iteration(run_dir, 10)  # past the save at 8
    fields = dict(t.split("=", 1) for t in subprocess.run(["scontrol", "show", "job", "-o", job_id],
                                                          capture_output=True, text=True).stdout.split() if "=" in t)
    nodes = subprocess.run(["scontrol", "show", "hostnames", fields["NodeList"]], capture_output=True,
                           text=True).stdout.split()
    lost = nodes[-1]
    conf_dir = slurm_cluster.conf_path.parent.parent  # <dir>/etc/slurm.conf
    pid = int((conf_dir / "run" / f"slurmd-{lost}.pid").read_text())
    try:
        os.kill(pid, 9)  # the node's daemon is gone: the controller can no longer reach it
        # What the controller concludes by itself after SlurmdTimeout (300 s by default): the node is down.
        subprocess.run(["scontrol", "update", f"nodename={lost}", "state=down", "reason=slurmd killed by test"],
                       check=True)
        k = check_resumed(run_dir, straight, job_id, sacct_job)
        assert k >= 8
        rerun = dict(t.split("=", 1) for t in subprocess.run(["scontrol", "show", "job", "-o", job_id],
                                                             capture_output=True, text=True).stdout.split()
                     if "=" in t)
        assert lost not in subprocess.run(["scontrol", "show", "hostnames", rerun["NodeList"]],
                                          capture_output=True, text=True).stdout.split()
    finally:
        _restart_slurmd(lost, conf_dir)


def test_a_crashed_worker_requeues_the_job_which_resumes(straight, sacct_job, tmp_path, worker_pids):
    run_dir = tmp_path / "crashed"
    job_id = submit(run_dir)
    wait_for_iteration(run_dir, 10)  # past the save at 8
    os.kill(worker_pids(run_dir)[1], 9)  # an OOM kill or a segfault: no marker, so the node script requeues
    k = check_resumed(run_dir, straight, job_id, sacct_job)
    assert k == 8  # nothing saved at the crash: the interval save
