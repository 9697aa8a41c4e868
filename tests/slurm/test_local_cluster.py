"""The local Slurm cluster behaves like a real multi-node cluster (slurm/local-cluster-start.sh)."""

from __future__ import annotations

import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def run(cmd: list[str], timeout: float = 60) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} -> exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    return proc.stdout


def sbatch(*args: str) -> str:
    """Submit with ``--parsable`` and return the job id."""
    return run(["sbatch", "--parsable", *args]).strip().split(";")[0]


def sacct_time(value: str) -> datetime:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S")


IDLE_TIMEOUT_S = 300
"""How long every node may take to be idle: this module runs after test_in_job_slurm.py, which takes nodes DOWN and
kills workers; a node back in service can stay out of reach (completing, not responding) for over a minute on a
loaded machine. Polled: idle nodes return at once."""


def test_all_nodes_idle(slurm_cluster):
    expected = {f"node{i}" for i in range(1, slurm_cluster.num_nodes + 1)}
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        lines = run(["sinfo", "-h", "-N", "-p", slurm_cluster.partition, "-o", "%N %T"]).split()
        states = dict(zip(lines[::2], lines[1::2]))
        if set(states) == expected and set(states.values()) == {"idle"}:
            break
        assert time.monotonic() < deadline, f"expected {sorted(expected)} idle, sinfo says {states}"
        time.sleep(0.5)


def test_two_node_job_sees_two_hostnames(slurm_cluster, sacct_job, tmp_path: Path):
    out = tmp_path / "hosts.out"
    job_id = sbatch(
        "--wait", "-N", "2", "--ntasks-per-node=1", "-p", slurm_cluster.partition,
        "-o", str(out), "--wrap", "srun -l hostname",
    )
    # Which two nodes: the scheduler's choice (a node that an earlier test's requeue released can stay out of its
    # reach for minutes on a loaded machine); two different ones, each task on its own.
    lines = sorted(line for line in out.read_text().split("\n") if line)
    assert [line.split(": ")[0] for line in lines] == ["0", "1"], lines
    hosts = [line.split(": ")[1] for line in lines]
    assert len(set(hosts)) == 2 and all(re.fullmatch(r"node[1-4]", h) for h in hosts), hosts
    # NodeList lags behind for ~2 s after a short job ends (shows only the batch node first)
    record = sacct_job(job_id, final=True, until=lambda r: "[" in r["NodeList"] or "," in r["NodeList"])
    assert (record["State"], record["ExitCode"]) == ("COMPLETED", "0:0")


def test_afterok_starts_after_parent_ended(slurm_cluster, sacct_job, tmp_path: Path):
    marker, go = tmp_path / "parent-done", tmp_path / "go"
    # The parent ends only once the test has seen the child wait (not after a fixed sleep, which a loaded machine's
    # slow sbatch and squeue could outlast); it gives up after 10 minutes, failing, rather than hold a node forever.
    parent = sbatch("-o", "/dev/null", "--wrap",
                    f"for i in $(seq 3000); do [ -e {go} ] && break; sleep 0.2; done; [ -e {go} ] && touch {marker}")
    child = sbatch(
        f"--dependency=afterok:{parent}", "-o", "/dev/null",
        "--wrap", f"test -e {marker}",  # fails if the parent has not finished
    )
    reason = run(["squeue", "-h", "-j", child, "-o", "%T %r"]).strip()
    go.touch()
    assert reason == "PENDING Dependency"
    parent_rec = sacct_job(parent, timeout=120, final=True)
    child_rec = sacct_job(child, timeout=120, final=True)
    assert parent_rec["State"] == "COMPLETED", parent_rec
    assert child_rec["State"] == "COMPLETED", child_rec
    assert sacct_time(child_rec["Start"]) >= sacct_time(parent_rec["End"])


def test_afterok_on_failed_parent_is_cancelled(slurm_cluster, sacct_job, tmp_path: Path):
    out = tmp_path / "child.out"
    parent = sbatch("-o", "/dev/null", "--wrap", "exit 3")
    child = sbatch(f"--dependency=afterok:{parent}", "-o", str(out), "--wrap", "echo child ran")
    # slurmdbd can show FAILED a moment before the exit code it records with it (CI read 'FAILED', '0:0' once): wait
    # for the code too; a job that really ended 0:0 times out here with its record shown
    parent_rec = sacct_job(parent, timeout=30, final=True, until=lambda r: r["ExitCode"] != "0:0")
    assert (parent_rec["State"], parent_rec["ExitCode"]) == ("FAILED", "3:0")
    # DependencyParameters=kill_invalid_depend: cancelled instead of pending forever
    child_rec = sacct_job(child, timeout=30, final=True)
    assert child_rec["State"].startswith("CANCELLED"), child_rec
    assert not out.exists() or out.read_text() == ""


def test_accounts_qos_and_features_are_enforced(slurm_cluster, sacct_job):
    """What the start script sets up for cluster-profile tests: the test account and QOS exist, nodes carry
    features, and sbatch refuses what a real site would refuse."""
    job = sbatch("--account=mhpc-test", "--qos=mhpc-high", "--constraint=rack2", "--exclude=node3",
                 "-o", "/dev/null", "--wrap", "true")
    record = sacct_job(job, timeout=30, final=True, until=lambda r: r["NodeList"] not in ("", "None assigned"))
    assert (record["State"], record["NodeList"]) == ("COMPLETED", "node4"), record
    for args, error in ((["--account=no-such-account"], "Invalid account"),
                        (["--qos=no-such-qos"], "Invalid qos specification"),
                        (["--qos=mhpc-high"], "Invalid qos specification"),  # root's default account may not
                        (["--constraint=no-such-feature"], "Invalid feature specification")):
        proc = subprocess.run(["sbatch", "--parsable", *args, "-o", "/dev/null", "--wrap", "true"],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode != 0 and error in proc.stderr, (args, proc.stderr)
