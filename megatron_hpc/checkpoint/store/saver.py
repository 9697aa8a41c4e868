"""save_checkpoint: write one checkpoint so that a crash at any point leaves the previous one usable.

Order (neuron-xla.md 1.3 lists the reference's race between the tensor writes and the tracker):
1. rank 0 creates iter_XXXXXXX.tmp-<token> (and removes temp folders of saves that died);
2. the DP-rank-0 rank of each (TP, PP) rank pair writes mp_rank_XX (mp_rank_XX_YYY with pipeline
   parallelism) there, at most io_workers_per_node writers of a node at a time (phases separated by
   barriers), fsyncing every file;
3. barrier; rank 0 writes manifest.json (size and crc32 of every file), renames the folder to
   iter_XXXXXXX, then writes the tracker atomically (temp file, fsync, os.replace);
4. rank 0 deletes all but the newest checkpoint.keep_last complete checkpoints.
Every rank takes part in the same collectives whatever fails, and all raise CheckpointError together.

The steps are also public (begin_save, write_rank_files, finish_save) so that async_save.py can run step 2 on a
thread while the collectives of steps 1 and 3 stay on the main thread. The offline writers (checkpoint/conversion/:
one process writes every rank, no collectives) call the two halves without them: write_rank_folder for each rank,
then commit_save, so their output has the same files, manifest and atomic tracker as a save by the trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from megatron_hpc.atomic_write import write_text_atomic
from megatron_hpc.checkpoint.store import paths
from megatron_hpc.checkpoint.store.compat import PipelineLayout
from megatron_hpc.checkpoint.store.file_io import Written, write_bytes_file
from megatron_hpc.checkpoint.store.manifest import FileRecord, Manifest, write_manifest
from megatron_hpc.checkpoint.store.ranks import RankInfo
from megatron_hpc.checkpoint.store.xser import write_torch, write_xser
from megatron_hpc.errors import CheckpointAccessError, CheckpointError

_PARTIAL = ".files.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(root: Path, iteration: int) -> None:
    """latest_checkpointed_iteration.txt = str(iteration), no newline, replaced atomically."""
    write_text_atomic(paths.tracker_file(root), str(iteration), durable=True)
    _fsync_dir(root)


def write_rank_folder(state: dict[str, Any], tmp: Path, *, tp_rank: int, pp_rank: int, pp_size: int,
                      fmt: str) -> None:
    """Rank (tp_rank, pp_rank)'s mp_rank_XX[_YYY] folder in the temp folder `tmp`, plus mp_rank_XX[_YYY].files.json
    (its files' records, which commit_save gathers into the manifest)."""
    records: dict[str, dict[str, Any]] = {}

    def on_written(path: Path, written: Written) -> None:  # called from the I/O threads; one key each
        records[path.relative_to(tmp).as_posix()] = FileRecord(size=written.size, crc32=written.crc32).to_json()

    main = paths.main_file(tmp, tp_rank, pp_rank, pp_size=pp_size)
    main.parent.mkdir()
    (write_xser if fmt == "xser" else write_torch)(state, main, on_written=on_written)
    partial = tmp / (paths.rank_dirname(tp_rank, pp_rank, pp_size=pp_size) + _PARTIAL)
    write_bytes_file(partial, json.dumps(records).encode("ascii"))


def commit_save(tmp: Path, root: Path, iteration: int, *, ranks: RankInfo, fmt: str,
                layout: PipelineLayout) -> Path:
    """Rank 0, after every writer finished: manifest, rename, tracker; returns the final folder."""
    files: dict[str, FileRecord] = {}
    for pp_rank in range(ranks.pp_size):
        for tp_rank in range(ranks.tp_size):
            partial = tmp / (paths.rank_dirname(tp_rank, pp_rank, pp_size=ranks.pp_size) + _PARTIAL)
            for rel, rec in json.loads(partial.read_text(encoding="ascii")).items():
                files[rel] = FileRecord.from_json(rec)
            partial.unlink()
    write_manifest(tmp, Manifest(iteration=iteration, format=fmt, tensor_parallel=ranks.tp_size,
                                 pipeline_parallel=ranks.pp_size, virtual_pipeline=layout.virtual,
                                 pipeline_first_stage_layers=layout.first_stage_layers,
                                 pipeline_last_stage_layers=layout.last_stage_layers,
                                 data_parallel=ranks.dp_size, world_size=ranks.world_size, files=files))
    _fsync_dir(tmp)
    final = paths.iteration_dir(root, iteration)
    if final.exists():  # a save of the same iteration by an earlier attempt: replace it
        old = tmp.with_name(tmp.name + "-replaced")
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(root)
    write_tracker(root, iteration)
    return final


def complete_iterations(root: Path) -> list[int]:
    """Iterations of the final-named folders that hold a manifest, ascending."""
    found = []
    try:
        if not root.is_dir():
            return []
        for entry in root.iterdir():
            iteration = paths.parse_iteration_dirname(entry.name)
            if iteration is not None and (entry / paths.MANIFEST).is_file():
                found.append(iteration)
    except PermissionError as exc:  # not "no checkpoint": starting from scratch would undo training
        raise CheckpointAccessError(exc.filename or root, exc) from None
    return sorted(found)


def prune(root: Path, *, keep_last: int, current: int) -> list[int]:
    """Delete complete checkpoints older than the newest `keep_last` up to `current`; returns them.

    Folders newer than `current` (left by another run in the same folder) are not touched. The
    manifest goes first, so a half-deleted folder is never taken for a complete one.
    """
    if keep_last <= 0:
        return []
    older = [i for i in complete_iterations(root) if i <= current]
    doomed = older[:-keep_last]
    for iteration in doomed:
        folder = paths.iteration_dir(root, iteration)
        (folder / paths.MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    return doomed


def _remove_stale_temps(root: Path, *, keep: Path) -> None:
    for entry in root.iterdir():
        if entry != keep and paths.is_temp_dirname(entry.name):
            shutil.rmtree(entry, ignore_errors=True)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return str(exc)


def _check_args(fmt: str, ranks: RankInfo, layout: PipelineLayout | None) -> PipelineLayout:
    if fmt not in ("xser", "torch"):
        raise CheckpointError(f"checkpoint.format {fmt!r} is not supported; use xser or torch")
    layout = layout or PipelineLayout(pipeline=ranks.pp_size)
    if layout.pipeline != ranks.pp_size:
        raise ValueError(f"layout has {layout.pipeline} pipeline stages, the mesh {ranks.pp_size}")
    return layout


def begin_save(root: Path, iteration: int, *, ranks: RankInfo) -> tuple[Path, OSError | None]:
    """Collective step 1: the shared temp folder, made by rank 0; (its path, rank 0's error or None)."""
    tmp = paths.temp_dir(root, iteration, ranks.shared_token())
    if ranks.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale_temps(root, keep=tmp)
            tmp.mkdir()
        except OSError as exc:
            return tmp, exc
    return tmp, None


def write_rank_files(state: Any, tmp: Path, *, ranks: RankInfo, fmt: str) -> None:
    """This rank's files (writers only; `state` may be an xser Snapshot). No collectives: any thread may call it."""
    if ranks.is_writer:
        write_rank_folder(state, tmp, tp_rank=ranks.tp_rank, pp_rank=ranks.pp_rank, pp_size=ranks.pp_size, fmt=fmt)


def finish_save(root: Path, iteration: int, tmp: Path, *, ranks: RankInfo, ok: bool, error: BaseException | None,
                fmt: str, keep_last: int, layout: PipelineLayout) -> Path:
    """Collective last step, after every rank's files were written or failed (`error`: this rank's failure, `ok`:
    whether all ranks agreed so far): rank 0 writes manifest, renames, writes the tracker, prunes."""
    ok = ranks.all_ok(error is None) and ok
    final = paths.iteration_dir(root, iteration)
    if ok and ranks.rank == 0:
        try:
            final = commit_save(tmp, root, iteration, ranks=ranks, fmt=fmt, layout=layout)
        except (OSError, ValueError, KeyError) as exc:
            error = exc
    ok = ranks.all_ok(error is None) and ok
    if not ok:
        if ranks.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = _describe(error) if error is not None else "another rank failed; see its log"
        raise CheckpointError(f"saving checkpoint {iteration} to {root} failed on rank {ranks.rank}: {reason}. "
                              f"The previous checkpoint is unchanged; free space in {root} or point "
                              "checkpoint.save elsewhere")
    if ranks.rank == 0:
        try:
            prune(root, keep_last=keep_last, current=iteration)
        except OSError as exc:
            print(f"megatron-hpc: warning: could not delete old checkpoints in {root}: {_describe(exc)}",
                  file=sys.stderr)
    return final


def save_checkpoint(root: Path, iteration: int, state: dict[str, Any], *, ranks: RankInfo, fmt: str = "xser",
                    io_workers_per_node: int = 4, keep_last: int = 0, layout: PipelineLayout | None = None) -> Path:
    """Write `state` (this rank's TP x PP shard) as checkpoint `iteration` under `root`; every rank calls it.

    `layout`: the run's pipeline layout, recorded in the manifest (default: ranks.pp_size stages, split evenly).
    Returns the final folder. Raises CheckpointError on every rank when any rank failed; the
    previous checkpoint and the tracker are then untouched.
    """
    layout = _check_args(fmt, ranks, layout)
    tmp, error = begin_save(root, iteration, ranks=ranks)
    ok = ranks.all_ok(error is None)
    # A writer's phase comes from its index among its node's writers (with PP they are not the node's first ranks).
    phases = ranks.num_write_phases(io_workers_per_node)
    my_phase = ranks.write_phase(io_workers_per_node) if ranks.is_writer else -1
    for phase in range(phases):
        if ok and phase == my_phase:
            try:
                write_rank_files(state, tmp, ranks=ranks, fmt=fmt)
            except (OSError, CheckpointError) as exc:
                error = exc
        ok = ranks.all_ok(error is None) and ok
    return finish_save(root, iteration, tmp, ranks=ranks, ok=ok, error=error, fmt=fmt, keep_last=keep_last,
                       layout=layout)
