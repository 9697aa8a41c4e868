"""find_checkpoint and load_checkpoint: choose the newest complete checkpoint and read this rank's shard.

A folder counts only when it has its final name and a manifest. The tracker decides which one
(Megatron's rule); when it names a folder that is missing or incomplete, the newest complete one at
or below it is taken, with a warning. No tracker means no checkpoint: start from scratch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_hpc.checkpoint.store import paths
from megatron_hpc.checkpoint.store.compat import PipelineLayout, check_fits, foreign_message, is_foreign
from megatron_hpc.checkpoint.store.manifest import Manifest, read_manifest
from megatron_hpc.checkpoint.store.ranks import RankInfo
from megatron_hpc.checkpoint.store.saver import complete_iterations
from megatron_hpc.checkpoint.store.xser import read_xser
from megatron_hpc.errors import CheckpointAccessError, CheckpointError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class FoundCheckpoint:
    folder: Path
    manifest: Manifest

    @property
    def iteration(self) -> int:
        return self.manifest.iteration


def _warn(message: str, *, quiet: bool) -> None:
    if not quiet:
        print(f"megatron-hpc: warning: {message}", file=sys.stderr, flush=True)


def _complete(folder: Path) -> Manifest | None:
    """The folder's manifest, None when it is missing or damaged; a manifest this process may not read raises
    (CheckpointAccessError): taking an older checkpoint instead would silently undo training."""
    try:
        return read_manifest(folder)
    except CheckpointAccessError:
        raise
    except CheckpointError:
        return None


def find_checkpoint(root: Path, *, quiet: bool = False) -> FoundCheckpoint | None:
    """The checkpoint a run resuming from `root` should load, or None to start from scratch."""
    tracker = paths.tracker_file(root)
    try:
        text = tracker.read_text(encoding="ascii")
    except FileNotFoundError:
        if complete_iterations(root):
            _warn(f"{root} has checkpoint folders but no {paths.TRACKER}; starting from scratch "
                  "(write the iteration into the tracker to resume from one)", quiet=quiet)
        return None
    except PermissionError as exc:
        raise CheckpointAccessError(tracker, exc) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {tracker} ({exc}); fix or delete it") from None
    named = paths.parse_tracker(text)
    if named is None:
        raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration or 'release'; write the "
                              "iteration to resume from, or delete the file to start from scratch")
    folder = paths.iteration_dir(root, named)
    manifest = _complete(folder)
    if manifest is not None:
        return FoundCheckpoint(folder=folder, manifest=manifest)
    limit = 0 if named == paths.RELEASE else int(named)
    for iteration in reversed(complete_iterations(root)):
        candidate = paths.iteration_dir(root, iteration)
        manifest = _complete(candidate) if iteration <= limit else None
        if manifest is not None:
            _warn(f"{tracker} names {folder.name}, which is missing or incomplete; loading {candidate.name}, "
                  "the newest complete checkpoint before it", quiet=quiet)
            return FoundCheckpoint(folder=candidate, manifest=manifest)
    if is_foreign(folder):  # shards but no manifest: nothing of ours died there, another trainer wrote it
        raise CheckpointError(foreign_message(folder, root=root))
    if folder.exists():  # files we could not use are no reason to throw the checkpoint away: no advice to delete
        raise CheckpointError(f"{tracker} names {folder.name}, which has no valid {paths.MANIFEST}, and {root} has no "
                              "complete checkpoint before it; restore that folder from a copy, or point "
                              "checkpoint.load at another checkpoint folder")
    raise CheckpointError(f"{tracker} names {folder.name}, which is missing or incomplete, and {root} has no "
                          "complete checkpoint before it; delete the tracker to start from scratch")


def check_mesh(found: FoundCheckpoint, *, tensor_parallel: int, layout: PipelineLayout | None = None) -> None:
    """CheckpointError with the `ckpt reshard` command when `found` was saved at another TP size or pipeline
    layout (default layout: no pipeline)."""
    check_fits(found.folder, found.manifest, tensor_parallel=tensor_parallel, layout=layout or PipelineLayout())


def read_shard(found: FoundCheckpoint, *, tp_rank: int, pp_rank: int = 0, verify: bool = True,
               into: dict[str, dict[str, torch.Tensor]] | None = None) -> Any:
    """The state of one TP x PP rank (CPU tensors), every file checked against the manifest.

    `into`: state dicts of existing tensors to read into, by top-level key (xser.read_xser)."""
    files = {found.folder / rel: rec for rel, rec in found.manifest.files.items()} if verify else None
    main = paths.main_file(found.folder, tp_rank, pp_rank, pp_size=found.manifest.pipeline_parallel)
    return read_xser(main, files=files, into=into)


def load_checkpoint(root: Path, *, ranks: RankInfo, io_workers_per_node: int = 4,
                    layout: PipelineLayout | None = None,
                    into: dict[str, dict[str, torch.Tensor]] | None = None) -> tuple[FoundCheckpoint, Any] | None:
    """Every rank calls it: None when there is no checkpoint, else the checkpoint and this rank's state.

    `into`: state dicts of this rank's tensors that already exist, by the saved object's top-level key
    (`{"model": model.state_dict()}`): those that fit are read straight into (xser.read_xser), and the state holds
    them in place of fresh tensors. On an error they may hold part of the checkpoint: the caller must not go on
    with them.

    Each rank reads its (TP, PP) file. `layout`: the run's pipeline layout (default: ranks.pp_size stages, split
    evenly); a checkpoint saved at another TP size or layout is refused with the reshard command. Every rank of a
    node reads, in phases of io_workers_per_node ranks by local rank, with a barrier between phases and no
    other collective inside them (the reference's load deadlocked on one: neuron-xla.md 1.3 (b)).
    """
    found = find_checkpoint(root, quiet=ranks.rank != 0)
    iteration = -1 if found is None else found.iteration
    if not ranks.same_everywhere(iteration):
        raise CheckpointError(f"ranks chose different checkpoints in {root} (rank {ranks.rank}: {iteration}); "
                              "is another job writing there? Point checkpoint.load at a stable folder")
    if found is None:
        return None
    check_mesh(found, tensor_parallel=ranks.tp_size, layout=layout or PipelineLayout(pipeline=ranks.pp_size))
    phases = paths.num_io_phases(ranks_per_node=ranks.ranks_per_node, io_workers_per_node=io_workers_per_node)
    my_phase = paths.io_phase(local_index=ranks.local_rank, io_workers_per_node=io_workers_per_node)
    state: Any = None
    error: CheckpointError | None = None
    for phase in range(phases):
        if phase == my_phase:
            try:
                state = read_shard(found, tp_rank=ranks.tp_rank, pp_rank=ranks.pp_rank, into=into)
            except CheckpointError as exc:
                error = exc
        ranks.all_ok(True)  # barrier only: ends the phase
    if not ranks.all_ok(error is None):
        raise error or CheckpointError(f"loading {found.folder} failed on another rank; see its log")
    return found, state
