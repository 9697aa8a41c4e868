"""The run folder: resolved config, plan, scripts and logs of one submission."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from megatron_hpc.errors import LaunchError
from megatron_hpc.run_folder import LOG_DIR


def default_run_dir(base: Path, recipe: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return base / recipe / stamp


def prepare_run_dir(path: Path) -> Path:
    """Create the folder (and logs/) or fail with a fix before anything is queued."""
    path = path.expanduser().resolve()
    try:
        (path / LOG_DIR).mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise LaunchError(f"cannot write the run folder {path}: {exc.strerror or exc}; "
                          "pass --out with a folder you can write (on a filesystem every node sees)") from None
    return path


def python_bin_dir() -> str:
    """The bin folder of the Python running megatron-hpc (its torchrun must run on the nodes)."""
    return str(Path(sys.executable).parent)
