"""The exception tree. A leaf module: it imports nothing from the project.

Every message says what was wrong, the values seen, and the fix. The CLI prints a
`MegatronHpcError` as one line and exits 1.
"""

from __future__ import annotations


class MegatronHpcError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(MegatronHpcError):
    """A recipe, override or cluster profile is invalid."""


class PlanError(MegatronHpcError):
    """The mesh, batch or memory plan cannot work for this recipe and cluster."""


class LaunchError(MegatronHpcError):
    """Submitting or running a job failed.

    Carries the sbatch path and the tail of stderr when there is one.
    """

    def __init__(self, message: str, *, script: str | None = None, stderr_tail: str | None = None):
        parts = [message]
        if script:
            parts.append(f"(script: {script})")
        if stderr_tail:
            parts.append(f"stderr: {stderr_tail.strip()}")
        super().__init__(" ".join(parts))
        self.script = script
        self.stderr_tail = stderr_tail


class CompileCacheError(MegatronHpcError):
    """The compile cache is unusable (bad root, corrupt entry, live lock)."""


class DataError(MegatronHpcError):
    """A dataset file is missing, corrupt or inconsistent."""


class CheckpointError(MegatronHpcError):
    """A checkpoint is missing, incomplete, corrupt or does not match the run."""


class TrainingError(MegatronHpcError):
    """Training cannot continue (NaN loss streak, bad feature combination)."""
