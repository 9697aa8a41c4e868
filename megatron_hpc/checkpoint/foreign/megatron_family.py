"""Megatron-family checkpoints written by other trainers: find their folder and shards, read them, name the family.

Layout (shared/reference/neuron-xla.md 1.3, megatron-and-launchers.md 3.1): `<save>/latest_checkpointed_iteration.txt`
names `iter_XXXXXXX` (or `release`), which holds one `mp_rank_{tp:02d}` folder per TP rank, `mp_rank_{tp:02d}_{pp:03d}`
with pipeline parallelism, each with `model_optim_rng.pt` (a plain torch file, or an xser main file beside its
`.tensors` folder). They have no manifest of ours. Families, told apart by the state dict (3.2-3.3):

- neuron-reference: the Neuron reference Megatron: its arguments flat at the top level (num_layers, hidden_size, ...),
  no `args`; the model nested as language_model / embedding / encoder;
- megatron-lm: Megatron-LM's legacy model (language_model / embedding / encoder, `transformer` in old versions) with
  an `args` Namespace;
- megatron-core: an `args` Namespace and megatron-core's flat model keys (embedding., decoder.layers.N., output_layer).

A folder of megatron-core's torch_dist format (metadata.json, .metadata, common.pt, *.distcp) is found here too and
read by torch_dist.py.

Reading goes through the restricted unpickler (store/file_io.py, safe_pickle.py): nothing in the files runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_hpc.checkpoint.store import paths, read_xser
from megatron_hpc.errors import CheckpointAccessError, CheckpointError

FAMILIES = ("neuron-reference", "megatron-lm", "megatron-core")
OURS = "megatron-hpc"
TORCH_DIST_FILES = ("metadata.json", ".metadata", "common.pt")
"""The files megatron-core's torch_dist format writes beside its *.distcp data (torch_dist_files.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFiles:
    """The shards of one foreign checkpoint folder."""

    folder: Path
    tensor_parallel: int
    pipeline_parallel: int
    mains: dict[tuple[int, int], Path]
    """model_optim_rng.pt of each (pp_rank, tp_rank)."""

    @property
    def format(self) -> str:
        return "xser" if paths.tensors_dir(self.mains[(0, 0)]).is_dir() else "torch"


@dataclass(frozen=True, kw_only=True, slots=True)
class ForeignCheckpoint:
    files: RankFiles
    family: str
    grid: list[list[dict[str, Any]]]
    """Each rank's state dict as written, indexed [pp_rank][tp_rank]."""

    @property
    def folder(self) -> Path:
        return self.files.folder

    @property
    def first(self) -> dict[str, Any]:
        return self.grid[0][0]


def arg(state: dict[str, Any], name: str, default: Any = None) -> Any:
    """A training argument: from Megatron-LM's `args` Namespace, else from the reference's flat keys."""
    if "args" in state:
        return getattr(state["args"], name, default)
    return state.get(name, default)


def rank_dirs(folder: Path) -> list[Path]:
    """The mp_rank_* folders in `folder` (none when it is not a folder)."""
    try:
        return sorted(p for p in folder.iterdir() if paths.parse_rank_dirname(p.name) and p.is_dir())
    except PermissionError as exc:
        raise CheckpointAccessError(exc.filename or folder, exc) from None
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_torch_dist(folder: Path) -> bool:
    """Whether `folder` holds (a part of) a megatron-core torch_dist checkpoint rather than mp_rank_* shards."""
    return any((folder / name).is_file() for name in TORCH_DIST_FILES) or any(folder.glob("*.distcp"))


def foreign_folder(path: Path) -> Path | None:
    """The iteration folder of a foreign checkpoint at `path` (a save folder with the tracker, or an iter_XXXXXXX or
    release folder; mp_rank_* shards or megatron-core's torch_dist files), None when `path` is ours (it has a
    manifest) or no checkpoint folder at all."""
    try:
        return _foreign_folder(path)
    except PermissionError as exc:  # a probe (is_dir, is_file) into a folder this user may not enter
        raise CheckpointAccessError(exc.filename or path, exc) from None


def _foreign_folder(path: Path) -> Path | None:
    if not path.is_dir():
        return None
    tracker = paths.tracker_file(path)
    if tracker.is_file():
        try:
            text = tracker.read_text(encoding="ascii")
        except PermissionError as exc:
            raise CheckpointAccessError(tracker, exc) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"cannot read {tracker} ({exc}); pass one of the iter_XXXXXXX folders "
                                  "beside it instead") from None
        named = paths.parse_tracker(text)
        if named is None:
            raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration or 'release'; pass one of the "
                                  "iter_XXXXXXX folders beside it instead")
        folder = paths.iteration_dir(path, named)
        if (folder / paths.MANIFEST).is_file():
            return None
        if not folder.is_dir():
            raise CheckpointError(f"{tracker} names {folder.name}, which is not in {path}; pass one of the "
                                  "iter_XXXXXXX folders beside it instead")
        path = folder
    if (path / paths.MANIFEST).is_file():
        return None
    if is_torch_dist(path):  # megatron-core's torch_dist: read by torch_dist.py
        return path
    return path if rank_dirs(path) else None


def rank_files(folder: Path) -> RankFiles:
    """Every shard of `folder`; CheckpointError naming what is missing when the TP x PP grid has holes."""
    found: dict[tuple[int, int], Path] = {}
    staged: set[bool] = set()
    for d in rank_dirs(folder):
        parsed = paths.parse_rank_dirname(d.name)
        assert parsed is not None  # rank_dirs kept only these
        tp, pp, ep = parsed
        if ep is not None:
            raise CheckpointError(f"{d} is an expert-parallel shard (mp_rank_TT_PPP_EEE); mixture-of-experts "
                                  "checkpoints are not supported")
        staged.add(pp is not None)
        found[(pp or 0, tp)] = d / paths.MAIN_FILE
    if len(staged) > 1:
        raise CheckpointError(f"{folder} mixes mp_rank_TT and mp_rank_TT_PPP folders; it holds parts of two "
                              "checkpoints, pass a folder written by one run")
    tp_size = max(t for _, t in found) + 1
    pp_size = max(p for p, _ in found) + 1
    holes = [(p, t) for p in range(pp_size) for t in range(tp_size) if (p, t) not in found]
    holes += [key for key, main in found.items() if not main.is_file()]
    if holes:
        p, t = sorted(holes)[0]
        name = paths.rank_dirname(t, p, pp_size=2 if True in staged else 1)  # the suffix as the folder spells it
        raise CheckpointError(f"{folder} has no {name}/{paths.MAIN_FILE} (a shard of its tp {tp_size} x pp {pp_size} "
                              f"grid, {len(holes)} missing); the checkpoint is incomplete, copy the missing shards "
                              "or pass another iteration")
    return RankFiles(folder=folder, tensor_parallel=tp_size, pipeline_parallel=pp_size, mains=found)


def family_of(state: Any, *, where: object) -> str:
    """Which trainer wrote this rank's state dict (FAMILIES, or OURS)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} holds a {type(state).__name__}, not a Megatron state dict; pass a "
                              "Megatron-family checkpoint")
    if "resolved_config" in state:
        return OURS
    model = state.get("model", state.get("model0"))
    if not isinstance(model, dict):
        raise CheckpointError(f"{where} has no model weights (no 'model' key; saved with --no-save-model?); pass "
                              "a checkpoint that holds the model")
    if "language_model" in model:
        return "megatron-lm" if "args" in state else "neuron-reference"
    if any(str(k).startswith(("decoder.", "embedding.")) for k in model):
        return "megatron-core"
    keys = ", ".join(list(map(str, model))[:4])
    raise CheckpointError(f"{where} holds a model of unknown layout (keys {keys}, ...); the Neuron reference, "
                          "Megatron-LM (language_model) and megatron-core (decoder.layers) GPT layouts are read")


def read_rank(main: Path, *, mmap: bool = False) -> dict[str, Any]:
    """One shard's state; with `mmap` its tensors map the files (read when touched, no checksum: foreign files have
    no manifest) where torch can map them (zip files), else they are read."""
    state = None
    if mmap:
        try:
            state = read_xser(main, mmap=True)
        except CheckpointError:  # torch's legacy (non-zip) format cannot be mapped; the plain read says what is wrong
            state = None
    if state is None:
        state = read_xser(main)
    if not isinstance(state, dict):
        raise CheckpointError(f"{main} holds a {type(state).__name__}, not a Megatron state dict; pass a "
                              "Megatron-family checkpoint")
    return state


def read_foreign(folder: Path, *, mmap: bool = False) -> ForeignCheckpoint:
    """Every shard of the foreign checkpoint in `folder` (an iteration folder), read into memory (with `mmap`:
    mapped, each tensor read when touched)."""
    files = rank_files(folder)
    grid = [[read_rank(files.mains[(p, t)], mmap=mmap) for t in range(files.tensor_parallel)]
            for p in range(files.pipeline_parallel)]
    families = {family_of(s, where=files.mains[(p, t)]) for p, row in enumerate(grid) for t, s in enumerate(row)}
    if len(families) > 1:
        raise CheckpointError(f"the shards of {folder} were written by different trainers ({sorted(families)}); "
                              "pass a folder written by one run")
    return ForeignCheckpoint(files=files, family=families.pop(), grid=grid)
