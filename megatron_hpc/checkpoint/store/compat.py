"""Whether a checkpoint fits a run: its TP size and pipeline layout against the run's. Torch-free, so `submit`
can run the same check before anything is queued.

A pipeline rank's file holds the weights of its layers only (checkpoint/conversion/pp_layout.py), so a checkpoint loads
only into a run that splits the layers the same way: same pipeline size, virtual stages and uneven first/last
stage sizes (parallel.pipeline, virtual_pipeline, pipeline_first_stage_layers, pipeline_last_stage_layers).
Anything else needs `megatron-hpc ckpt reshard` first; the refusal prints that command.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_hpc.checkpoint.store import paths
from megatron_hpc.checkpoint.store.manifest import Manifest, read_manifest
from megatron_hpc.errors import CheckpointError
from megatron_hpc.plan.stages import stage_layouts


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineLayout:
    """How a run splits its transformer layers over pipeline ranks (plan/stages.py's arguments)."""

    pipeline: int = 1
    virtual: int = 1
    first_stage_layers: int = 0
    last_stage_layers: int = 0

    @classmethod
    def of_run(cls, *, plan: dict[str, Any] | None, config: dict[str, Any] | None) -> PipelineLayout:
        """From a resolved plan and config (plan.json, config.json, or a checkpoint's resolved_plan and
        resolved_config). The plan's sizes win (the planner may choose them); keys absent read as no pipeline."""
        plan = plan if isinstance(plan, dict) else {}
        parallel = (config or {}).get("parallel") if isinstance(config, dict) else None
        parallel = parallel if isinstance(parallel, dict) else {}
        pipeline = plan.get("pipeline_parallel") or parallel.get("pipeline") or 1
        virtual = plan.get("virtual_pipeline") or parallel.get("virtual_pipeline") or 1
        return cls(pipeline=int(pipeline), virtual=int(virtual),
                   first_stage_layers=int(parallel.get("pipeline_first_stage_layers") or 0),
                   last_stage_layers=int(parallel.get("pipeline_last_stage_layers") or 0))

    @classmethod
    def of_manifest(cls, manifest: Manifest) -> PipelineLayout:
        return cls(pipeline=manifest.pipeline_parallel, virtual=manifest.virtual_pipeline,
                   first_stage_layers=manifest.pipeline_first_stage_layers,
                   last_stage_layers=manifest.pipeline_last_stage_layers)

    def rank_layers(self, num_layers: int, pp_rank: int) -> list[int]:
        """Global indices of the layers pipeline rank `pp_rank` holds, all its virtual chunks, ascending."""
        stages = stage_layouts(num_layers, pipeline=self.pipeline, virtual=self.virtual,
                               first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers)
        return sorted(i for s in stages if s.pp_rank == pp_rank for i in s.layers)

    def describe(self) -> str:
        """'pp 4', 'pp 2 x virtual 2', 'pp 4 (first stage 3 layers, last 5)'."""
        out = f"pp {self.pipeline}" + (f" x virtual {self.virtual}" if self.virtual > 1 else "")
        uneven = [f"{what} {n} layers" for what, n in (("first stage", self.first_stage_layers),
                                                       ("last stage", self.last_stage_layers)) if n]
        return out + (f" ({', '.join(uneven)})" if uneven else "")

    def reshard_flags(self) -> str:
        """The `ckpt reshard` options that produce this layout (beyond --tp)."""
        flags = f"--pp {self.pipeline}"
        if self.virtual > 1:
            flags += f" --virtual-pipeline {self.virtual}"
        if self.first_stage_layers:
            flags += f" --pipeline-first-stage-layers {self.first_stage_layers}"
        if self.last_stage_layers:
            flags += f" --pipeline-last-stage-layers {self.last_stage_layers}"
        return flags


def reshard_out(folder: Path, *, tensor_parallel: int, layout: PipelineLayout) -> Path:
    """The default output of `ckpt reshard` for the checkpoint in `folder`: <root>-tp<N>[-pp<M>] beside its root."""
    root = folder.parent if paths.parse_iteration_dirname(folder.name) is not None else folder
    suffix = f"-tp{tensor_parallel}" + (f"-pp{layout.pipeline}" if layout.pipeline > 1 else "")
    return root.with_name(root.name + suffix)


def check_fits(folder: Path, manifest: Manifest, *, tensor_parallel: int, layout: PipelineLayout) -> None:
    """CheckpointError, in one line with the `ckpt reshard` command that fixes it, when the checkpoint in `folder`
    was saved at another TP size or pipeline layout than the run's."""
    saved = PipelineLayout.of_manifest(manifest)
    if manifest.tensor_parallel == tensor_parallel and saved == layout:
        return
    out = reshard_out(folder, tensor_parallel=tensor_parallel, layout=layout)
    raise CheckpointError(
        f"{folder} was saved at tp {manifest.tensor_parallel} x {saved.describe()} but this run has "
        f"tp {tensor_parallel} x {layout.describe()}; reshard it with `megatron-hpc ckpt reshard "
        f"{folder} --tp {tensor_parallel} {layout.reshard_flags()} --out {out}` and set checkpoint.load={out}, or "
        f"run with parallel.tensor={manifest.tensor_parallel} parallel.pipeline={saved.pipeline}")


def foreign_message(folder: Path, *, root: Path | None = None) -> str:
    """Why a checkpoint folder of another trainer is not loaded as it is, and the command that converts it (given
    its save folder `root`, or the folder itself)."""
    return (f"{folder} holds Megatron shards without our manifest.json: a checkpoint written by another trainer "
            f"(the Neuron reference or Megatron-LM); convert it with `megatron-hpc ckpt convert {root or folder} "
            "--to xser --out DIR` and set checkpoint.load=DIR")


def is_foreign(folder: Path) -> bool:
    """Whether `folder` holds mp_rank_* shards but no manifest of ours: our saves rename a folder to its final name
    only after writing the manifest, so such a folder was written by another trainer."""
    try:
        return not (folder / paths.MANIFEST).exists() and any(
            paths.parse_rank_dirname(p.name) is not None and p.is_dir() for p in folder.iterdir())
    except OSError:
        return False


def check_finetune_source(root: Path) -> None:
    """CheckpointError when checkpoint.finetune=true names a checkpoint.load that holds no checkpoint: the run would
    train from its random initialisation (the trainer starts fresh without one), which a fine-tune never means."""
    try:
        if (paths.tracker_file(root).is_file() or (root / paths.MANIFEST).is_file()
                or any(paths.parse_iteration_dirname(p.name) is not None for p in root.iterdir())):
            return
        why = "no checkpoint in it"
    except FileNotFoundError:
        why = "it does not exist"
    except OSError as exc:
        why = f"it cannot be read: {exc.strerror or exc}"
    raise CheckpointError(f"checkpoint.load={root} holds no checkpoint to fine-tune from ({why}; "
                          f"{root.absolute()} from here), so the run would train from random weights; pass the "
                          "folder `ckpt convert` or a run wrote, as an absolute path")


def check_before_queue(root: Path, *, tensor_parallel: int, layout: PipelineLayout) -> None:
    """The pre-queue form of the loader's check: the checkpoint the tracker under `root` names, when there is one
    with a readable manifest (anything less is left to the trainer, which falls back or starts fresh)."""
    try:
        named = paths.parse_tracker(paths.tracker_file(root).read_text(encoding="ascii"))
    except (OSError, UnicodeDecodeError):
        return
    if named is None:
        return
    folder = paths.iteration_dir(root, named)
    if is_foreign(folder):
        raise CheckpointError(foreign_message(folder, root=root))
    try:
        manifest = read_manifest(folder)
    except CheckpointError:
        return
    check_fits(folder, manifest, tensor_parallel=tensor_parallel, layout=layout)
