"""Job state from SLURM's accounting (sacct), falling back to squeue while a job is queued."""

from __future__ import annotations

import subprocess


def job_state(job_id: str) -> str:
    """The job's state word (COMPLETED, FAILED, CANCELLED, PENDING, RUNNING...), or UNKNOWN."""
    out = _run(["sacct", "-j", job_id, "-X", "--noheader", "--parsable2", "-o", "State"])
    if out:
        # "CANCELLED by 0" -> "CANCELLED"; a requeued job lists one line per run: the last is current.
        return out.splitlines()[-1].split()[0]
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    return out.splitlines()[0].strip() if out else "UNKNOWN"


def _run(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""
