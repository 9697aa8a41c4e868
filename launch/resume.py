"""`submit --resume RUN`: submit a run folder again, so that the run continues from its checkpoints.

The stored config and plan are the run's identity: only keys that change neither the model, the mesh,
the batch nor the data order may be overridden (more steps, other save or log intervals, a new time
limit). The trainer then resumes by itself from <run>/checkpoints (or checkpoint.save). A run that is
still queued or running is refused: two attempts would write the same checkpoints.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from megatron_hpc.launch.run_status import RunStatus

from megatron_hpc.errors import ConfigError, LaunchError
from megatron_hpc.heartbeat import hang_timeout_problem
from megatron_hpc.run_folder import (
    METRICS_FILE,
    PLAN_FILE,
    SUBMISSION_FILE,
    IterationRecord,
    SubmissionRecord,
    read_json,
    read_metrics,
)

RESUMABLE_KEYS = frozenset({
    "optim.lr_decay_iters", "optim.lr_decay_samples",
    "train.num_steps", "train.log_interval", "train.eval_interval", "train.eval_iters", "train.tensorboard",
    "train.max_skipped_steps", "checkpoint.save_interval", "checkpoint.keep_last", "checkpoint.time_budget_min",
    "checkpoint.on_save_failure", "checkpoint.io_workers_per_node", "checkpoint.async_save", "launch.time_limit_min",
    "launch.compile_time_limit_min", "compile.num_steps",
    "compile.enabled",
    # What watches the run and where it runs, not what it computes (issue 28).
    "launch.hang_timeout_s", "launch.straggler_threshold", "launch.spare_nodes", "launch.max_in_job_restarts",
    "launch.exclude_stragglers", "launch.warm_restart",
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


def _override_keys(overrides: list[str]) -> dict[str, str]:
    return {item.split("=", 1)[0].strip(): item.split("=", 1)[1].strip() for item in overrides if "=" in item}


def keep_lr_horizon(stored: dict[str, Any], overrides: list[str]) -> tuple[list[str], str | None]:
    """Overrides that keep the LR schedule's decay horizon when a resume only changes train.num_steps.

    An unset lr_decay_iters (or, counted in samples, lr_decay_samples) means "decay over train.num_steps", so
    more steps would stretch the cosine and raise the LR of the steps already past. Megatron keeps the
    scheduler's horizon from the checkpoint; here it is written into the resumed config instead, where `plan`
    shows it. Returns (extra overrides, a sentence for the resume summary, or None when nothing changes).
    """
    given = _override_keys(overrides)
    optim, train = stored.get("optim", {}), stored.get("train", {})
    old_steps = train.get("num_steps")
    if "train.num_steps" not in given or str(old_steps) == given["train.num_steps"]:
        return [], None
    if "optim.lr_decay_iters" in given or "optim.lr_decay_samples" in given:
        return [], "the LR decay horizon is the one you set"
    samples = bool(optim.get("lr_warmup_samples")) or optim.get("lr_decay_samples") is not None
    key = "optim.lr_decay_samples" if samples else "optim.lr_decay_iters"
    if optim.get(key.split(".")[1]) is not None:
        return [], f"the LR schedule keeps its decay horizon ({key}={optim[key.split('.')[1]]})"
    horizon = old_steps * train.get("global_batch_size", 1) if samples else old_steps
    unit = "samples" if samples else "iterations"
    return [f"{key}={horizon}"], (f"the LR schedule keeps its decay horizon of {horizon} {unit} ({key}; past it the "
                                  f"LR stays at optim.min_lr); set {key}=N with the resume to stretch it")


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
        return read_json(run_dir / PLAN_FILE)
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{run_dir / PLAN_FILE} cannot be read ({exc}); is it a run folder written by "
                          "submit?") from None


def previous_submissions(run_dir: Path) -> list[dict[str, Any]]:
    """Earlier submission records of the folder, oldest first (kept when it is submitted again)."""
    try:
        record = SubmissionRecord.from_json(read_json(run_dir / SUBMISSION_FILE))
    except (OSError, ValueError, AttributeError):
        return []
    history, record.history = record.history, []
    return [*history, record.to_json()]


def check_hang_timeout(run_dir: Path, hang_timeout_s: float | None) -> None:
    """Refuse a launch.hang_timeout_s shorter than the steps this run measured (metrics.jsonl, past the warm-up):
    the watchdog would tear every step down. A run that logged no step yet is checked by the trainer itself."""
    try:
        rows = read_metrics(run_dir / METRICS_FILE)
    except OSError:
        return
    timed = [r for r in rows if isinstance(r, IterationRecord) and r.phase == "run" and not r.warmup]
    if not timed:
        return
    step_s = statistics.median(r.elapsed_ms for r in timed) / 1000.0
    problem = hang_timeout_problem(configured=hang_timeout_s, measured_step_s=step_s, iteration=timed[-1].iteration)
    if problem:
        raise ConfigError(problem)
