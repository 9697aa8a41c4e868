"""Whole checkpoints in one process: read every TP x PP rank's state, and write a new checkpoint from them.

For the offline tools (`ckpt convert`, `ckpt reshard`), which run on one machine without a process
group. Writing goes through the saver's own per-rank writer and finisher (write_rank_folder, commit_save), so the
result has the same layout, manifest and atomic tracker as a checkpoint the trainer saved. `ckpt convert` and `ckpt
reshard` read our checkpoints a tensor at a time instead (lazy.py); another TP x PP size is stream.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_hpc.checkpoint.store import (
    FoundCheckpoint,
    PipelineLayout,
    RankInfo,
    commit_save,
    find_checkpoint,
    foreign_message,
    is_foreign,
    paths,
    read_manifest,
    read_shard,
    staged_iteration,
    write_rank_folder,
)
from megatron_hpc.errors import CheckpointAccessError, CheckpointError


@dataclass(frozen=True, kw_only=True, slots=True)
class WholeCheckpoint:
    found: FoundCheckpoint
    grid: list[list[dict[str, Any]]]
    """One state dict per rank, indexed [pp_rank][tp_rank]."""

    @property
    def iteration(self) -> int:
        return self.found.iteration

    @property
    def tensor_parallel(self) -> int:
        return len(self.grid[0])

    @property
    def pipeline_parallel(self) -> int:
        return len(self.grid)

    @property
    def layout(self) -> PipelineLayout:
        return PipelineLayout.of_manifest(self.found.manifest)

    @property
    def first(self) -> dict[str, Any]:
        """The state of TP rank 0 on pipeline rank 0 (its config, plan and progress stand for all)."""
        return self.grid[0][0]


def model_config(whole: WholeCheckpoint) -> dict[str, Any]:
    """The model section of the run's resolved config (what converting and resharding go by)."""
    try:
        return whole.first["resolved_config"]["model"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{whole.found.folder} has no resolved_config (not written by megatron-hpc); "
                              "it cannot be converted") from None


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
    if found is None and is_foreign(path):
        raise CheckpointError(foreign_message(path))
    weights = _hf_weights_without_config(path) if found is None else None
    if weights is not None:
        raise CheckpointError(f"{path} holds Hugging Face weights ({weights}) but no config.json, which names the "
                              "architecture and its shape; copy the model's config.json beside them")
    if found is None:
        # A run folder keeps its checkpoints in checkpoints/ (run_folder.CHECKPOINT_DIR, a room this one does not
        # import): name it when that is what was passed.
        inner = path / "checkpoints"
        fix = (f"it is a run folder: pass {inner}" if inner.is_dir() and find_checkpoint(inner) is not None
               else "pass the folder a run saved into")
        raise CheckpointError(f"{path} holds no complete checkpoint (no {paths.TRACKER} naming a folder with a "
                              f"{paths.MANIFEST}); {fix}")
    return found


def _hf_weights_without_config(path: Path) -> str | None:
    """The first Hugging Face weight file in a folder that lacks config.json (a copy that left it behind), or None:
    otherwise the folder would be refused as a checkpoint of ours without its tracker."""
    try:
        if not path.is_dir() or (path / "config.json").exists():
            return None
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        return None
    return next((n for n in names if n.endswith(".safetensors") or (n.startswith("pytorch_model") and
                                                                    n.endswith(".bin"))), None)


def read_whole(path: Path, *, iteration: int | None = None) -> WholeCheckpoint:
    found = locate(path, iteration=iteration)
    m = found.manifest
    grid = [[read_shard(found, tp_rank=t, pp_rank=p) for t in range(m.tensor_parallel)]
            for p in range(m.pipeline_parallel)]
    return WholeCheckpoint(found=found, grid=grid)


def write_whole(root: Path, iteration: int, grid: list[list[dict[str, Any]]], *, fmt: str,
                layout: PipelineLayout | None = None) -> Path:
    """A complete checkpoint `iteration` under `root` from a [pp_rank][tp_rank] grid of states; the tracker last.

    `layout`: the pipeline layout the grid was split by, recorded in the manifest (default: len(grid) stages, even).
    """
    if fmt not in ("xser", "torch"):
        raise CheckpointError(f"format {fmt!r} is not supported; use xser or torch")
    pp, tp = len(grid), len(grid[0])
    layout = layout or PipelineLayout(pipeline=pp)
    if layout.pipeline != pp or any(len(row) != tp for row in grid):
        raise ValueError(f"a grid of {[len(row) for row in grid]} states for {layout.describe()}")
    with staged_iteration(root, iteration) as tmp:
        for p, row in enumerate(grid):
            for t, state in enumerate(row):
                write_rank_folder(state, tmp, tp_rank=t, pp_rank=p, pp_size=pp, fmt=fmt)
        ranks = RankInfo(world_size=tp * pp, tp_size=tp, pp_size=pp)
        return commit_save(tmp, root, iteration, ranks=ranks, fmt=fmt, layout=layout)

