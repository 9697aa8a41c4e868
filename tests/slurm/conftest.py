"""Fixtures for tests that need a real Slurm cluster.

``slurm_cluster`` (session scope) starts the single-machine Slurm 22.05 cluster of
``slurm/local-cluster-start.sh`` (installing the Debian packages on first use), exports
``SLURM_CONF`` (and one thread per worker and compile for the jobs) for the whole session and stops
the cluster at the end. It fails - never skips - when the cluster cannot be started. Knobs: the ``MHPC_SLURM_*``
variables of the start script.

``sacct_job`` returns a function that reads one job's accounting record.

``cancel_leftover_jobs`` (every test) cancels, when the test ends, the jobs it queued that are still in the
queue (a test that failed or timed out while its jobs ran), and waits until they have left it: the next test
finds the nodes free and the queue as it expects.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
START_SCRIPT = REPO_ROOT / "slurm" / "local-cluster-start.sh"
STOP_SCRIPT = REPO_ROOT / "slurm" / "local-cluster-stop.sh"

START_TIMEOUT_S = 900  # includes apt-get install on a fresh machine
STOP_TIMEOUT_S = 120
SACCT_FIELDS = ("JobID", "State", "Start", "End", "ExitCode", "NodeList")
TERMINAL_STATES = (
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED",
    "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
)


@dataclass(frozen=True)
class LocalCluster:
    conf_path: Path
    num_nodes: int
    partition: str
    log_dir: Path


def pytest_configure(config: pytest.Config) -> None:
    registered = config.getini("markers")
    if not any(line.split(":")[0].strip() == "slurm" for line in registered):
        config.addinivalue_line("markers", "slurm: needs the local Slurm cluster (slurm_cluster fixture)")


def _run_script(script: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a cluster script; stdout+stderr merged so a failure shows them in order."""
    try:
        return subprocess.run(
            ["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else (exc.output or "")
        return subprocess.CompletedProcess(exc.cmd, returncode=-1, stdout=out + f"\n[timed out after {timeout} s]")


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalCluster]:
    _run_script(STOP_SCRIPT, STOP_TIMEOUT_S)  # a leftover cluster from an aborted session
    started = _run_script(START_SCRIPT, START_TIMEOUT_S)
    if started.returncode != 0:
        _run_script(STOP_SCRIPT, STOP_TIMEOUT_S)
        pytest.fail(
            f"{START_SCRIPT.name} failed (exit {started.returncode}); output tail:\n{_tail(started.stdout)}",
            pytrace=False,
        )
    cluster_dir = Path(os.environ.get("MHPC_SLURM_DIR", "/tmp/megatron-hpc-slurm"))
    cluster = LocalCluster(
        conf_path=cluster_dir / "etc" / "slurm.conf",
        num_nodes=int(os.environ.get("MHPC_SLURM_NODES", "4")),  # validated by the start script
        partition="debug",
        log_dir=cluster_dir / "log",
    )
    # Jobs take the submitting environment (sbatch's default --export=ALL). Every simulated node is this machine:
    # one intra-op thread per worker (given all of its cores, what the trainer takes with one worker per node, a
    # worker contends with the other nodes' and the suite's other tiers, its threads spinning while they wait for
    # a core), and Inductor compiles in the worker instead of starting its pool of compile processes (each one
    # imports torch again: more than it saves for graphs this small on two shared cores).
    session_env = {"SLURM_CONF": str(cluster.conf_path), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    old_env = {name: os.environ.get(name) for name in session_env}
    os.environ.update(session_env)
    try:
        yield cluster
    finally:
        stopped = _run_script(STOP_SCRIPT, STOP_TIMEOUT_S)
        for name, value in old_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if stopped.returncode != 0:
            print(f"{STOP_SCRIPT.name} failed (exit {stopped.returncode}):\n{_tail(stopped.stdout)}")


def read_sacct(job_id: str) -> dict[str, str] | None:
    """One sacct query: the allocation line of ``job_id`` as a dict, or None if not (yet) there."""
    out = subprocess.run(
        ["sacct", "-j", str(job_id), "-X", "--parsable2", "--noheader", "-o", ",".join(SACCT_FIELDS)],
        capture_output=True, text=True, timeout=30,
    )
    for line in out.stdout.splitlines():
        values = line.split("|")
        if len(values) == len(SACCT_FIELDS) and values[0] == str(job_id):
            return dict(zip(SACCT_FIELDS, values))
    return None


SACCT_TIMEOUT_S = 60.0
"""The default wait for a job's record: slurmctld hands a job's end to slurmdbd through a queue, and slurmdbd writes
it to MariaDB, each a process among the suite's busy tiers; a record seconds late is no failure. Polled: a record
that is there returns at once."""


def wait_sacct(
    job_id: str,
    timeout: float = SACCT_TIMEOUT_S,
    final: bool = False,
    until: Callable[[dict[str, str]], bool] | None = None,
) -> dict[str, str]:
    """Poll sacct until ``job_id`` shows up; with ``final=True`` until it is in a terminal state,
    with ``until`` until ``until(record)`` is true as well.

    ``State`` may carry a suffix such as ``CANCELLED by 0``. For a second or two after a short job
    ends, slurmdbd's record can be incomplete (e.g. NodeList only the batch node): use ``until``.
    Raises AssertionError on timeout, showing the last record seen.
    """
    deadline = time.monotonic() + timeout
    while True:
        record = read_sacct(job_id)
        if (
            record is not None
            and (not final or record["State"].split()[0] in TERMINAL_STATES)
            and (until is None or until(record))
        ):
            return record
        if time.monotonic() > deadline:
            raise AssertionError(
                f"sacct: job {job_id} not as expected after {timeout} s "
                f"(final={final}, until={until}); last record: {record}"
            )
        time.sleep(0.25)


@pytest.fixture
def sacct_job(slurm_cluster: LocalCluster) -> Callable[..., dict[str, str]]:
    """``sacct_job(job_id, timeout=SACCT_TIMEOUT_S, final=False, until=None)`` -> dict with the keys
    JobID, State, Start, End, ExitCode, NodeList (see ``wait_sacct``)."""
    return wait_sacct


QUEUE_LEAVE_TIMEOUT_S = 120


def queued_jobs() -> set[str]:
    """The ids of every job in the queue, whatever its state."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30, check=True)
    return set(out.stdout.split())


def cancel_and_wait(job_ids: list[str], timeout: float = QUEUE_LEAVE_TIMEOUT_S) -> None:
    """scancel the jobs and wait until none of them is in the queue (CG, completing, included)."""
    if not job_ids:
        return
    subprocess.run(["scancel", *job_ids], capture_output=True, text=True, timeout=60)
    deadline = time.monotonic() + timeout
    while left := sorted(set(job_ids) & queued_jobs()):
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {left} still in the queue {timeout} s after scancel")
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def cancel_leftover_jobs(request: pytest.FixtureRequest) -> Iterator[None]:
    """When a test ends, cancel the jobs queued during it that are still queued or running.

    Fixtures of a wider scope (a module's reference run) are set up before this one, so their jobs are in the
    queue when it starts and are left alone. Nothing to do where no cluster was started."""
    if "slurm_cluster" not in request.fixturenames or not os.environ.get("SLURM_CONF"):
        yield
        return
    before = queued_jobs()
    yield
    cancel_and_wait(sorted(queued_jobs() - before))
