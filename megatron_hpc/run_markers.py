"""Marker files through which the trainer and the node task talk, in the run folder. No torch here.

- `stop-request`: the node task got SLURM's signal; rank 0 sees it at the next check (for process
  trackers that signal only the node task, not the workers).
- `stopped.json`: the trainer stopped early, after saving; the node task requeues the job.
- `fatal.json`: the trainer failed on an error that a retry cannot fix (bad config, data or
  checkpoint); the node task must not requeue.

Each record names the SLURM job id and attempt (SLURM_RESTART_COUNT) that wrote it, so a marker
left by an earlier attempt is never taken for the current one.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatron_hpc.run_folder import FATAL_FILE, STOP_REQUEST_FILE, STOPPED_FILE, read_json, write_json

__all__ = ["FATAL_FILE", "STOPPED_FILE", "STOP_REQUEST_FILE", "FatalMarker", "StoppedMarker", "clear_marker",
           "job_attempt", "read_fatal", "read_marker", "read_stopped", "write_marker", "write_record"]


def job_attempt(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, Any]:
    """This SLURM attempt: the job id (None outside SLURM) and SLURM_RESTART_COUNT (0 before any requeue)."""
    env = os.environ if environ is None else environ
    return {"job_id": env.get("SLURM_JOB_ID"), "attempt": int(env.get("SLURM_RESTART_COUNT", "0") or 0)}


def write_marker(run_dir: Path, name: str, record: dict[str, Any]) -> Path:
    """Write `name` atomically with this attempt's identity added."""
    return write_json(run_dir / name, {**record, **job_attempt(), "time": time.time()}, indent=1)


def read_marker(run_dir: Path, name: str, environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The marker written by this attempt, or None (absent, unreadable, or from another attempt)."""
    try:
        record = read_json(run_dir / name)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    mine = job_attempt(environ)
    return record if all(record.get(k) == v for k, v in mine.items()) else None


def clear_marker(run_dir: Path, name: str) -> None:
    """Remove a marker of an earlier attempt (outside SLURM every attempt looks the same)."""
    (run_dir / name).unlink(missing_ok=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class StoppedMarker:
    """stopped.json: the trainer stopped early, after saving (the node task requeues the job)."""

    iteration: int | None
    reason: str
    """What stopped it: SLURM's warning signal, SIGTERM, a stop request, the time budget."""
    checkpoint: str | None = None
    """The checkpoint folder it saved, or None when there was nowhere to save."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoppedMarker:
        return cls(iteration=data.get("iteration"), reason=str(data.get("reason", "?")),
                   checkpoint=data.get("checkpoint"))


@dataclass(frozen=True, kw_only=True, slots=True)
class FatalMarker:
    """fatal.json: the phase failed on an error a retry cannot fix (the node task does not requeue)."""

    phase: str
    kind: str
    """The exception's type (ConfigError, PlanError, ValueError, ...)."""
    error: str
    """Its message (our one line, or the exception's text), at most 2000 characters."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FatalMarker:
        return cls(phase=str(data.get("phase", "?")), kind=str(data.get("kind", "error")),
                   error=str(data.get("error", "")))


def write_record(run_dir: Path, record: StoppedMarker | FatalMarker) -> Path:
    """Write a typed marker (stopped.json or fatal.json) with this attempt's identity."""
    name = STOPPED_FILE if isinstance(record, StoppedMarker) else FATAL_FILE
    return write_marker(run_dir, name, asdict(record))


def read_stopped(run_dir: Path, environ: dict[str, str] | None = None) -> StoppedMarker | None:
    """This attempt's stopped.json, or None."""
    data = read_marker(run_dir, STOPPED_FILE, environ)
    return None if data is None else StoppedMarker.from_json(data)


def read_fatal(run_dir: Path, environ: dict[str, str] | None = None) -> FatalMarker | None:
    """This attempt's fatal.json, or None."""
    data = read_marker(run_dir, FATAL_FILE, environ)
    return None if data is None else FatalMarker.from_json(data)
