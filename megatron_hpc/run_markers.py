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
from pathlib import Path
from typing import Any

from megatron_hpc.run_folder import FATAL_FILE, STOP_REQUEST_FILE, STOPPED_FILE, read_json, write_json

__all__ = ["FATAL_FILE", "STOPPED_FILE", "STOP_REQUEST_FILE", "clear_marker", "job_attempt", "read_marker",
           "write_marker"]


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
