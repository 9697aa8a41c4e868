"""Whole checkpoints in one process: read every TP rank's state, and write a new checkpoint from them.

For the offline tools (`ckpt convert`, `ckpt reshard`), which run on one machine without a process
group. Writing goes through the saver's own per-rank writer and finisher, so the result has the same
layout, manifest and atomic tracker as a checkpoint the trainer saved.
"""

from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_hpc.checkpoint import paths
from megatron_hpc.checkpoint.loader import FoundCheckpoint, find_checkpoint, read_shard
from megatron_hpc.checkpoint.manifest import read_manifest
from megatron_hpc.checkpoint.ranks import RankInfo
from megatron_hpc.checkpoint.saver import _finish, _write_rank
from megatron_hpc.errors import CheckpointAccessError, CheckpointError


@dataclass(frozen=True, kw_only=True, slots=True)
class WholeCheckpoint:
    found: FoundCheckpoint
    states: list[dict[str, Any]]
    """One state dict per TP rank, in rank order."""

    @property
    def iteration(self) -> int:
        return self.found.iteration

    @property
    def tensor_parallel(self) -> int:
        return len(self.states)


def locate(path: Path, *, iteration: int | None = None) -> FoundCheckpoint:
    """A checkpoint root (the tracker picks, or `iteration`) or one iter_XXXXXXX folder."""
    try:
        return _locate(path, iteration=iteration)
    except PermissionError as exc:  # a probe (exists, is_file) into a folder this user may not enter
        raise CheckpointAccessError(exc.filename or path, exc) from None


def _locate(path: Path, *, iteration: int | None) -> FoundCheckpoint:
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a checkpoint folder (with "
                              f"{paths.TRACKER}) or one of its iter_XXXXXXX folders")
    if iteration is not None:
        path = paths.iteration_dir(path, iteration)
    if (path / paths.MANIFEST).is_file():
        return FoundCheckpoint(folder=path, manifest=read_manifest(path))
    found = find_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"{path} holds no complete checkpoint (no {paths.TRACKER} naming a folder with a "
                              f"{paths.MANIFEST}); pass the folder a run saved into")
    return found


def read_whole(path: Path, *, iteration: int | None = None) -> WholeCheckpoint:
    found = locate(path, iteration=iteration)
    states = [read_shard(found, tp_rank=r) for r in range(found.manifest.tensor_parallel)]
    return WholeCheckpoint(found=found, states=states)


def write_whole(root: Path, iteration: int, states: list[dict[str, Any]], *, fmt: str) -> Path:
    """A complete checkpoint `iteration` under `root` from one state per TP rank; the tracker last."""
    if fmt not in ("xser", "torch"):
        raise CheckpointError(f"format {fmt!r} is not supported; use xser or torch")
    root.mkdir(parents=True, exist_ok=True)
    tmp = paths.temp_dir(root, iteration, secrets.token_hex(4))
    tmp.mkdir()
    tp = len(states)
    try:
        for rank, state in enumerate(states):
            _write_rank(state, tmp, tp_rank=rank, fmt=fmt)
        return _finish(tmp, root, iteration, ranks=RankInfo(world_size=tp, tp_size=tp), fmt=fmt)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing {root} failed ({exc}); nothing was left behind") from None
