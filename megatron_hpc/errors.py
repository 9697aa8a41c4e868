"""The exception tree. A leaf module: it imports nothing from the project.

Every message says what was wrong, the values seen, and the fix. The CLI prints a
`MegatronHpcError` as one line and exits 1. `access_problem` words a file that could not be opened
the same way in every domain.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

ACCESS_FIX = "make it readable to this user (chmod, or ask its owner) or run as a user who can read it"


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


class CheckpointAccessError(CheckpointError):
    """A checkpoint file or folder this process may not read. Not damage: never a reason to load an older
    checkpoint, nor to delete anything."""

    def __init__(self, path: str | os.PathLike[str], exc: OSError):
        super().__init__(f"cannot read {path}: {access_problem(path, exc)}; {ACCESS_FIX}")
        self.path = Path(path)


class TrainingError(MegatronHpcError):
    """Training cannot continue (NaN loss streak, bad feature combination)."""


class GenerationError(MegatronHpcError):
    """A generation request that cannot run: a prompt longer than the context, a bad sampling parameter."""


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def access_problem(path: str | os.PathLike[str], exc: OSError) -> str:
    """Why `path` could not be opened, for a message. For a permission error: which file or folder refuses
    (the first folder on the way this user cannot enter, else the file), its mode and owner, and who asked;
    otherwise the system's words."""
    if not isinstance(exc, PermissionError):
        return exc.strerror or str(exc)
    target = Path(os.path.abspath(path))
    culprit = next((p for p in reversed(target.parents) if not os.access(p, os.X_OK)), target)
    try:
        st = os.stat(culprit)
    except OSError:
        return f"permission denied to {_user(os.geteuid())}"
    where = "" if culprit == target else f"the folder {culprit} has "
    return (f"permission denied: {where}mode {stat.S_IMODE(st.st_mode):04o}, owner {_user(st.st_uid)}, and this "
            f"process runs as {_user(os.geteuid())}")
