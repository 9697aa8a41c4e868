"""`megatron-hpc restart RUN --exclude NODE`: ask a run's in-job driver to move its workers off some nodes.

The request is `<run>/restart-request.json`; the driver (launch/in_job.py) polls it, leaves the stop request the
trainer already heeds, the workers save at their next step and exit, and the next step starts without those
nodes. Everything is checked before the file is written: a run that is not running, one without an in-job driver
(launch.spare_nodes 0), a node the job does not hold, or so many exclusions that fewer than the run's nodes
remain, each get one line with the fix and nothing is written. No torch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_hpc.launch.restart_rules import healthy_nodes
from megatron_hpc.launch.run_status import RunStatus
from megatron_hpc.launch.slurm_nodes import allocation_nodes, unusable_nodes

from megatron_hpc.errors import LaunchError
from megatron_hpc.run_folder import CONFIG_FILE, RESTART_REQUEST_FILE, read_json, write_json


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartRequest:
    """restart-request.json."""

    job_id: str
    exclude: list[str]
    requested_at: float

    @classmethod
    def read(cls, run_dir: Path) -> RestartRequest | None:
        try:
            data = read_json(run_dir / RESTART_REQUEST_FILE)
            return cls(job_id=str(data["job_id"]), exclude=[str(n) for n in data["exclude"]],
                       requested_at=float(data["requested_at"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _spare_nodes(run_dir: Path) -> int:
    try:
        return int((read_json(run_dir / CONFIG_FILE).get("launch") or {}).get("spare_nodes") or 0)
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def check_request(status: RunStatus, exclude: list[str], *, allocation: tuple[str, ...],
                  unusable: frozenset[str]) -> str:
    """The running run job's id, or LaunchError with the fix. `allocation` and `unusable` are SLURM's view."""
    run = Path(status.run_dir)
    if status.cluster != "slurm":
        raise LaunchError(f"{run} ran with --cluster {status.cluster}; in-job restarts need --cluster slurm")
    spares = _spare_nodes(run)
    if not spares:
        raise LaunchError(f"{run} has no in-job driver (launch.spare_nodes is 0), so nothing can restart it inside "
                          f"its job; cancel it (`megatron-hpc cancel {run}`) and `megatron-hpc submit --resume {run} "
                          "--set launch.spare_nodes=1`, or resubmit with --exclude NODE")
    jobs = [j for j in status.jobs if j.phase == "run"]
    if not jobs or jobs[-1].state.split()[0] != "RUNNING":
        state = f"job {jobs[-1].job_id} is {jobs[-1].state}" if jobs else "it has no run job"
        raise LaunchError(f"{run} is not running ({state}): there is no step to restart; "
                          f"`megatron-hpc submit --resume {run}` continues a finished or failed run")
    job = jobs[-1].job_id
    foreign = [n for n in exclude if n not in allocation]
    if foreign:
        raise LaunchError(f"{', '.join(foreign)} not in job {job}'s allocation ({','.join(allocation) or 'none'}); "
                          "pass --exclude with nodes of that list")
    num_nodes = int(status.plan.get("num_nodes", 1))
    left = healthy_nodes(allocation, unusable=unusable, excluded=exclude)
    if len(left) < num_nodes:
        raise LaunchError(f"excluding {', '.join(exclude)} leaves {len(left)} healthy node(s) in job {job} "
                          f"({','.join(left) or 'none'}), and the run needs {num_nodes}; exclude fewer nodes, or "
                          f"cancel and resubmit with more launch.spare_nodes (now {spares})")
    return job


def request_restart(status: RunStatus, exclude: list[str]) -> RestartRequest:
    """Check, then write the request for the running job's driver."""
    jobs = [j for j in status.jobs if j.phase == "run"]
    allocation = allocation_nodes(jobs[-1].job_id) if jobs and status.cluster == "slurm" else ()
    job = check_request(status, exclude, allocation=allocation, unusable=unusable_nodes(allocation))
    request = RestartRequest(job_id=job, exclude=list(dict.fromkeys(exclude)), requested_at=time.time())
    write_json(Path(status.run_dir) / RESTART_REQUEST_FILE, asdict(request))
    return request
