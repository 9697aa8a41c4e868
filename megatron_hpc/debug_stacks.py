"""Where each trainer rank writes its Python stacks on request, and how it is asked. No torch here.

Every rank of a run registers `faulthandler` on SIGUSR1 at start, writing all its threads' stacks
to `<run_dir>/debug/rank-<R>.stacks` (appending). `megatron-hpc debug` uses this when py-spy is
not installed on the nodes: it notes the file's size, signals the rank and reads what was added.
faulthandler writes from a C signal handler, so it answers even when the rank is blocked inside a
collective, which is exactly when it is needed. SIGUSR2 and SIGTERM are the preemption signals
(train/stop.py), so the dump uses SIGUSR1.
"""

from __future__ import annotations

import faulthandler
import signal
from pathlib import Path
from typing import IO

from megatron_hpc.run_folder import DEBUG_DIR

STACK_SIGNAL = signal.SIGUSR1

_open_files: list[IO[str]] = []
"""Kept open for the process's lifetime: faulthandler holds only the file descriptor."""


def stacks_file(run_dir: Path, rank: int) -> Path:
    return run_dir / DEBUG_DIR / f"rank-{rank}.stacks"


def register_stack_dump(run_dir: Path, rank: int) -> Path:
    """Make SIGUSR1 append this process's stacks to its rank's file; returns the file."""
    path = stacks_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = path.open("a")
    _open_files.append(fh)
    faulthandler.register(STACK_SIGNAL, file=fh, all_threads=True, chain=False)
    return path
