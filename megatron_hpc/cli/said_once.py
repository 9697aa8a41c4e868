"""An error line said once per node under torchrun, not once per local rank.

Every rank of `torchrun --nproc_per_node N -m megatron_hpc evaluate|generate|serve ...` usually fails the same way
(a missing checkpoint, a bad flag, the wrong process count), and N copies of one line bury it among torchrun's own
report. The local ranks share their parent, torchrun's agent: the first rank to claim a line (a file created with
O_EXCL, named for the agent and the line) prints it, the others stay quiet. A line that differs, such as one rank's
own failure, is claimed on its own and printed too, so nothing is lost; when the claim cannot be made the line is
printed anyway.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

KEEP_S = 24 * 3600.0
"""Claims older than this are removed by the next claim (they are a few bytes each, one per failed launch)."""


def _agent_identity() -> str | None:
    """The parent's pid and start time: unique on this host even after the pid is reused."""
    ppid = os.getppid()
    try:
        stat = Path(f"/proc/{ppid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces; the start time is field 22, the 20th after its closing paren
    fields = stat.rsplit(")", 1)[-1].split()
    return f"{ppid}-{fields[19]}" if len(fields) > 19 else None


def _prune(folder: Path, now: float) -> None:
    for path in folder.iterdir():
        try:
            if now - path.stat().st_mtime > KEEP_S:
                path.unlink()
        except OSError:  # another rank removed it first
            pass


def first_to_say(line: str, environ: Mapping[str, str] | None = None) -> bool:
    """False when another local rank of this torchrun launch has already said `line`; True otherwise."""
    env = os.environ if environ is None else environ
    if int(env.get("LOCAL_WORLD_SIZE", "1") or 1) <= 1:
        return True
    agent = _agent_identity()
    if agent is None:
        return True
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = hashlib.sha256(f"{agent}:{restart}:{line}".encode()).hexdigest()[:32]
    folder = Path(tempfile.gettempdir()) / f"megatron-hpc-said-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        _prune(folder, time.time())
        os.close(os.open(folder / key, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:  # a full or read-only temp folder: say it rather than lose it
        return True
    return True
