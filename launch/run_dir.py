"""The run folder: resolved config, plan, scripts and logs of one submission."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from megatron_hpc.errors import LaunchError

NODE_SCRIPT = "node.sh"


def default_run_dir(base: Path, recipe: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return base / recipe / stamp


def prepare_run_dir(path: Path) -> Path:
    """Create the folder (and logs/) or fail with a fix before anything is queued."""
    path = path.expanduser().resolve()
    try:
        (path / "logs").mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise LaunchError(f"cannot write the run folder {path}: {exc.strerror or exc}; "
                          "pass --out with a folder you can write (on a filesystem every node sees)") from None
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write_script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def python_bin_dir() -> str:
    """The bin folder of the Python running megatron-hpc (its torchrun must run on the nodes)."""
    return str(Path(sys.executable).parent)
