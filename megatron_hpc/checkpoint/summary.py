"""summarize: what `megatron-hpc ckpt inspect` prints, for a checkpoint root, folder or single file: ours, or a
Megatron-family one written by another trainer (`family` says which; checkpoint/foreign/megatron_family.py).

Tensor files are memory-mapped, so listing shapes does not read the weights. A single file may be
an xser main file written by real torch_xla (CPU tensors inline, the rest as TensorReference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_hpc.checkpoint.foreign import (
    OURS,
    arg,
    family_of,
    foreign_folder,
    is_torch_dist,
    rank_files,
    torch_dist_summary,
)
from megatron_hpc.checkpoint.store import (
    FoundCheckpoint,
    find_checkpoint,
    iter_tensors,
    paths,
    read_manifest,
    read_shard,
    read_xser,
)
from megatron_hpc.errors import CheckpointAccessError, CheckpointError


def _tensor_rows(state: Any, *, tp_rank: int | None, pp_rank: int | None = None) -> list[dict[str, Any]]:
    rows = []
    for name, t in iter_tensors(state):
        row: dict[str, Any] = {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        if tp_rank is not None:
            row["tp_rank"] = tp_rank
        if pp_rank is not None:
            row["pp_rank"] = pp_rank
        rows.append(row)
    return rows


def _family(state: Any, *, where: Path) -> str | None:
    try:
        return family_of(state, where=where)
    except CheckpointError:
        return None


def _single_file(main: Path) -> dict[str, Any]:
    state = read_xser(main, mmap=True)
    top = state if isinstance(state, dict) else {}
    config = top.get("resolved_config") if isinstance(top.get("resolved_config"), dict) else {}
    tp = arg(top, "tensor_model_parallel_size", (config.get("parallel") or {}).get("tensor"))
    pp = arg(top, "pipeline_model_parallel_size", (config.get("parallel") or {}).get("pipeline"))
    return {"path": str(main), "family": _family(state, where=main), "iteration": top.get("iteration"),
            "format": "xser" if paths.tensors_dir(main).is_dir() else "torch", "tensor_parallel": tp,
            "pipeline_parallel": pp, "virtual_pipeline": None, "data_parallel": None, "world_size": None,
            "files": None, "bytes": None, "checkpoint_version": top.get("checkpoint_version"),
            "precision": _precision(top), "tensors": _tensor_rows(state, tp_rank=None)}


def _foreign(folder: Path) -> dict[str, Any]:
    """A checkpoint of another trainer: its shards' tensors under their own names (mapped, not read)."""
    files = rank_files(folder)
    rows: list[dict[str, Any]] = []
    families, first = set(), None
    for (pp_rank, tp_rank), main in sorted(files.mains.items()):
        state = read_xser(main, mmap=True)
        first = state if first is None else first
        families.add(family_of(state, where=main))
        rows += _tensor_rows(state, tp_rank=tp_rank, pp_rank=pp_rank)
    top = first if isinstance(first, dict) else {}
    chunks = sum(1 for k in top if isinstance(k, str) and k.startswith("model") and k[5:].isdigit())
    return {"path": str(folder), "family": "/".join(sorted(families)),
            "iteration": 0 if folder.name == paths.RELEASE else top.get("iteration"), "format": files.format,
            "tensor_parallel": files.tensor_parallel, "pipeline_parallel": files.pipeline_parallel,
            "virtual_pipeline": chunks or 1, "data_parallel": None, "world_size": None,
            "files": None, "bytes": None, "checkpoint_version": top.get("checkpoint_version"),
            "model": {k: arg(top, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size",
                                                "max_position_embeddings", "tokenizer_type")},
            "consumed_train_samples": arg(top, "consumed_train_samples"), "precision": None, "tensors": rows}


def _precision(top: Any) -> dict[str, Any] | None:
    """What the trainer recorded the weights to hold (checkpoint/store/contents.py); None for checkpoints without it."""
    record = top.get("precision") if isinstance(top, dict) else None
    return record if isinstance(record, dict) else None


def _folder(found: FoundCheckpoint, *, verify: bool) -> dict[str, Any]:
    m = found.manifest
    rows: list[dict[str, Any]] = []
    precision = None
    pp = m.pipeline_parallel
    for pp_rank in range(pp):
        for tp_rank in range(m.tensor_parallel):
            state = (read_shard(found, tp_rank=tp_rank, pp_rank=pp_rank) if verify
                     else read_xser(paths.main_file(found.folder, tp_rank, pp_rank, pp_size=pp), mmap=True))
            rows += _tensor_rows(state, tp_rank=tp_rank, pp_rank=pp_rank)
            precision = precision or _precision(state)
    return {"path": str(found.folder), "family": OURS, "iteration": m.iteration, "format": m.format,
            "tensor_parallel": m.tensor_parallel, "pipeline_parallel": pp, "virtual_pipeline": m.virtual_pipeline,
            "data_parallel": m.data_parallel, "world_size": m.world_size,
            "files": len(m.files), "bytes": sum(r.size for r in m.files.values()), "verified": verify,
            "precision": precision, "tensors": rows}


def summarize(path: Path, *, verify: bool = False) -> dict[str, Any]:
    """Iteration, mesh and every tensor (name, shape, dtype) of a checkpoint.

    `path`: a checkpoint root (the tracker picks the folder), an iter_XXXXXXX folder, an
    mp_rank_XX (mp_rank_XX_YYY) folder, or one main file. `verify`: check every file against the manifest.
    """
    try:
        return _summarize(path, verify=verify)
    except PermissionError as exc:  # a probe (is_file) into a folder this user may not enter
        raise CheckpointAccessError(exc.filename or path, exc) from None


def _summarize(path: Path, *, verify: bool) -> dict[str, Any]:
    if not path.exists():  # a typo, not a folder without checkpoint files: say so, as `ckpt convert` does
        raise CheckpointError(f"{path} does not exist; pass a checkpoint folder (with {paths.TRACKER}), one of its "
                              "iter_XXXXXXX folders or a model_optim_rng.pt file")
    if path.is_file():
        return _single_file(path)
    folder = foreign_folder(path)
    if folder is not None:
        return torch_dist_summary(folder, verify=verify) if is_torch_dist(folder) else _foreign(folder)
    if (path / paths.MAIN_FILE).is_file():
        return _single_file(path / paths.MAIN_FILE)
    if (path / paths.MANIFEST).is_file():
        return _folder(FoundCheckpoint(folder=path, manifest=read_manifest(path)), verify=verify)
    if path.is_dir():
        found = find_checkpoint(path)
        if found is not None:
            return _folder(found, verify=verify)
    raise CheckpointError(f"{path} is not a checkpoint: no {paths.TRACKER}, {paths.MANIFEST} or "
                          f"{paths.MAIN_FILE} there; pass a checkpoint folder or a model_optim_rng.pt file")
