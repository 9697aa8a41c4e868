"""`submit --resume RUN`: submit a run folder again, so that the run continues from its checkpoints.

The stored config and plan are the run's identity: only keys that change neither the model, the mesh,
the batch nor the data order may be overridden (more steps, other save or log intervals, a new time
limit). The trainer then resumes by itself from <run>/checkpoints (or checkpoint.save). A run that is
still queued or running is refused: two attempts would write the same checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_hpc.launch.run_status import RunStatus

from megatron_hpc.errors import ConfigError, LaunchError

RESUMABLE_KEYS = frozenset({
    "train.num_steps", "train.log_interval", "train.eval_interval", "train.eval_iters", "train.tensorboard",
    "train.max_skipped_steps", "checkpoint.save_interval", "checkpoint.keep_last", "checkpoint.time_budget_min",
    "checkpoint.on_save_failure", "checkpoint.io_workers_per_node", "launch.time_limit_min",
    "launch.compile_time_limit_min", "compile.num_steps",
    "compile.enabled",
})
ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED",
                           "RESIZING", "REQUEUE_HOLD", "REQUEUE_FED", "SUBMITTED"})


def check_overrides(overrides: list[str]) -> None:
    """Refuse --set keys that would make the resumed run another run."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key not in RESUMABLE_KEYS:
            raise ConfigError(f"--set {key} cannot change on --resume (it changes the model, mesh, batch or data "
                              f"order); allowed: {', '.join(sorted(RESUMABLE_KEYS))}. For a different run, "
                              f"submit --recipe ... --set checkpoint.load=<this run's checkpoints>")


def check_not_active(status: RunStatus) -> None:
    # Only SLURM's own word counts: a state remembered from submit time may be long out of date.
    active = [j for j in status.jobs if j.state.split()[0] in ACTIVE_STATES and j.source in ("scontrol", "sacct")]
    local_unfinished = status.cluster == "local" and any(j.state == "RUNNING" for j in status.jobs)
    if active or local_unfinished:
        which = ", ".join(f"{j.phase} job {j.job_id} is {j.state}" for j in (active or status.jobs))
        raise LaunchError(f"{status.run_dir} is still active ({which}); wait for it to end, or stop it with "
                          f"`megatron-hpc cancel {status.run_dir}`, then resume")


def stored_plan(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "plan.json").read_text())
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{run_dir}/plan.json cannot be read ({exc}); is it a run folder written by "
                          "submit?") from None


def previous_submissions(run_dir: Path) -> list[dict[str, Any]]:
    """Earlier submission records of the folder, oldest first (kept when it is submitted again)."""
    try:
        record = json.loads((run_dir / "submission.json").read_text())
    except (OSError, ValueError):
        return []
    history = record.pop("history", [])
    return [*history, record]
