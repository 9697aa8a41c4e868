"""A checkpoint of ours read a part at a time, for `ckpt convert` and `ckpt reshard` (issue 27): what read_whole
reads, with every weight and Adam moment a meta tensor whose values a stream.Source fetches when a writer needs them.

A Llama 70B trained by us is about 1 TB with Adam; read_whole held all of it before the first byte was written.
Here the manifest and each rank's structure (names, shapes, dtypes, the small tensors: steps, RNG states) are read
up front, and a weight or moment is read when stream.reshard, the Hugging Face export or the torch_dist export asks
for it. A value read stays held until its last user releases it while the held bytes fit `budget`; one read past
the budget is held only until the next read and read again if asked for later (torch_dist_stream.StreamedReader's
rule, per tensor here: every tensor of ours can be read alone). `peak_bytes` is the reader's own count of what it held
at once (the test of the bound reads it).

How the bytes are read differs by format, on purpose:
- xser keeps each tensor in its own file, so a fetch reads just that file into fresh memory, checked against the
  manifest's crc32 on the way (store's read_torch_file), and releasing it frees that memory.
- torch keeps a rank's whole state in one file. It is checked against the manifest first, a chunk at a time
  (verify_file), then mapped (torch.load mmap=True) for its structure, and a fetch reads the tensor's bytes from the
  file into fresh memory (pread at its data record's offset). Mapping alone would do for the host (mapped pages are
  the page cache's, clean and reclaimable), but they count in the process's RSS while mapped, and one file's mapping
  lives until its last tensor goes: RSS grew by each source rank's whole file as it was read (3.42 GiB against 1.43
  of one output rank: benchmarks/RESULTS.md, issue 27, "A checkpoint of ours streamed"). Nothing reads the mapping's
  pages now, so they never become resident.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.conversion import optim_layout, pp_layout, stream
from megatron_hpc.checkpoint.conversion.whole import WholeCheckpoint, locate
from megatron_hpc.checkpoint.store import (
    FoundCheckpoint,
    PipelineLayout,
    RankInfo,
    commit_save,
    data_records,
    paths,
    read_references,
    read_torch_file,
    read_xser,
    resolve,
    staged_iteration,
    tensor_layout,
    verify_file,
    write_rank_folder,
)
from megatron_hpc.errors import CheckpointError

Key = tuple[int, int, str, str]
"""(pp_rank, tp_rank, weight name, role): role is `weight` or the moment's key (exp_avg, exp_avg_sq, ...)."""


@dataclass(kw_only=True)
class OwnReader:
    """Our checkpoint's weights and moments by Key, read when fetched; see the module docstring for the budget."""

    loads: dict[tuple[int, int, str], dict[str, Callable[[], torch.Tensor]]]
    """(pp_rank, tp_rank, name) -> role -> how to read it."""
    budget: int
    held_bytes: int = 0
    peak_bytes: int = 0
    reads: int = 0
    _cache: dict[Key, torch.Tensor] = field(default_factory=dict)
    _transient: Key | None = None

    def fetch(self, key: Key) -> torch.Tensor:
        if key in self._cache:
            return self._cache[key]
        if self._transient is not None:
            self._drop(self._transient)
        value = self.loads[key[:3]][key[3]]()
        size = value.numel() * value.element_size()
        self._cache[key] = value
        self.held_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.reads += 1
        if self.held_bytes > self.budget:
            self._transient = key
        return value

    def release(self, p: int, t: int, name: str) -> None:
        """`name` of rank (p, t), its moments with it, will not be fetched again."""
        for role in self.loads.pop((p, t, name), {}):
            self._drop((p, t, name, role))

    def _drop(self, key: Key) -> None:
        value = self._cache.pop(key, None)
        if value is not None:
            self.held_bytes -= value.numel() * value.element_size()
        if self._transient == key:
            self._transient = None


def read_lazy(path: Path, *, iteration: int | None = None, budget: int) -> tuple[stream.Source, OwnReader]:
    """Our checkpoint at `path` (as read_whole finds it) as a stream.Source whose whole holds meta weights and
    moments, and the reader behind it."""
    found = locate(path, iteration=iteration)
    m = found.manifest
    loads: dict[tuple[int, int, str], dict[str, Callable[[], torch.Tensor]]] = {}
    files = {found.folder / rel: rec for rel, rec in m.files.items()}
    grid = [[_rank(found, files, p, t, loads) for t in range(m.tensor_parallel)] for p in range(m.pipeline_parallel)]
    reader = OwnReader(loads=loads, budget=budget)
    whole = WholeCheckpoint(found=found, grid=grid)
    source = stream.Source(whole=whole, weight=lambda p, t, n: reader.fetch((p, t, n, "weight")),
                           release=reader.release, moment=lambda p, t, n, role: reader.fetch((p, t, n, role)),
                           unit=lambda p, t, n: _unit(n))
    return source, reader


def _unit(name: str) -> str:
    layer = pp_layout.layer_of(name)
    return name if layer is None else f"layer {layer}"


def _rank(found: FoundCheckpoint, files: dict[Path, Any], p: int, t: int,
          loads: dict[tuple[int, int, str], dict[str, Callable[[], torch.Tensor]]]) -> dict[str, Any]:
    """Rank (p, t)'s state with its weights and moments meta (their loads put in `loads`), the rest read; `files`:
    the manifest's records by path."""
    m = found.manifest
    main = paths.main_file(found.folder, t, p, pp_size=m.pipeline_parallel)
    record = files.get(main)
    if record is None:
        raise CheckpointError(f"{main} is not listed in the checkpoint's manifest; the checkpoint is damaged or was "
                              "modified, load an earlier one")
    if m.format == "xser":
        stand_ins: dict[int, Callable[[], torch.Tensor]] = {}
        ref = read_references(main, files=files)
        state = resolve(ref, lambda tid: _xser_stand_in(paths.tensor_file(main, tid), files, stand_ins))
    else:
        verify_file(main, record)
        state = read_xser(main, mmap=True)
        stand_ins = _torch_file_reads(main, _tensors(state))
    lazy = _lazy(state)
    for (name, role), tensor in lazy.items():
        loads.setdefault((p, t, name), {})[role] = stand_ins[id(tensor)]
    wanted = {id(x) for x in lazy.values()}
    # Everything else (steps, RNG states) is small: read now, copied out of a mapping so it does not pin the file.
    return _replace(state, lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta") if id(x) in wanted
                    else stand_ins[id(x)]().clone())


def _torch_file_reads(main: Path, mapped: list[torch.Tensor]) -> dict[int, Callable[[], torch.Tensor]]:
    """id(tensor) -> a read of its storage's bytes from `main` into fresh memory, for the tensors torch.load mapped
    from it (mmap=True lays every storage at the mapping's start + its data record's offset, which is how each is
    found); the mapped tensors themselves when the file's records do not line up so (an unusual file)."""
    as_mapped = {id(x): (lambda x=x: x) for x in mapped}
    records = data_records(main)
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in mapped
                if x.untyped_storage().nbytes()}
    if not records or not storages:
        return as_mapped
    base = min(storages) - min((o for o, n in records.items() if n), default=0)
    if any(records.get(ptr - base) != n for ptr, n in storages.items()):
        return as_mapped

    def read(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        data = torch.empty(storage.nbytes(), dtype=torch.uint8)
        view, offset = memoryview(data.numpy()), storage.data_ptr() - base
        with open(main, "rb", buffering=0) as fh:
            while view.nbytes:  # one read(2) stops at 2 GiB on Linux; a 70B model's embeddings are more
                fh.seek(offset)
                done = fh.readinto(view)
                if not done:
                    raise CheckpointError(f"{main} changed while it was read (shorter than its records); load it "
                                          "again")
                view, offset = view[done:], offset + done
        return torch.empty(0, dtype=x.dtype).set_(data.untyped_storage(), x.storage_offset(), x.shape, x.stride())

    return {id(x): (lambda x=x: read(x)) for x in mapped}


def _xser_stand_in(path: Path, files: dict[Path, Any], stand_ins: dict[int, Callable[[], torch.Tensor]]
                   ) -> torch.Tensor:
    """A meta tensor of the file's tensor (its zip directory and header read, not its elements), and how to read it
    checked against the manifest."""
    record = files.get(path)
    if record is None:
        raise CheckpointError(f"{path} is not listed in the checkpoint's manifest; the checkpoint is damaged or was "
                              "modified, load an earlier one")

    def load() -> torch.Tensor:
        value = read_torch_file(path, expected=record)
        if type(value) is not torch.Tensor:
            raise CheckpointError(f"{path} holds a {type(value).__name__}, not one tensor; the checkpoint is damaged")
        return value

    layout = tensor_layout(path, expected=record)
    if layout is None:  # an unusual file: read whole now (read_torch_file checks and reports it)
        value = load()
        meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
        stand_ins[id(meta)] = lambda: value
        return meta
    meta = torch.empty(layout.shape, dtype=layout.dtype, device="meta")
    stand_ins[id(meta)] = load
    return meta


def _lazy(state: dict[str, Any]) -> dict[tuple[str, str], torch.Tensor]:
    """(name, role) -> the stand-in of each weight and each moment (tensors of one dim or more) of the state."""
    model = state.get("model")
    if not isinstance(model, dict):
        raise CheckpointError("a rank's state holds no model dict; it was not written by megatron-hpc's trainer")
    out = {(name, "weight"): w for name, w in model.items() if torch.is_tensor(w)}
    optimizer = state.get("optimizer")
    if isinstance(optimizer, dict):
        try:
            moments = optim_layout.by_name(model, optimizer)
        except (KeyError, ValueError, TypeError):  # not the trainer's AdamW: stream.reshard drops it with a note
            moments = {}
        for name, named in moments.items():
            out.update(((name, role), v) for role, v in named.items() if torch.is_tensor(v) and v.ndim)
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _tensors(v)]
    return []


def _replace(value: Any, swap: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with each tensor swapped (one swap per tensor object: aliases stay aliases)."""
    done: dict[int, torch.Tensor] = {}

    def walk(v: Any) -> Any:
        if torch.is_tensor(v):
            if id(v) not in done:
                done[id(v)] = swap(v)
            return done[id(v)]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        return v

    return walk(value)


def convert_lazy(source: stream.Source, *, to: str, out: Path) -> Path:
    """The same checkpoint (every rank, every key, the pipeline layout) in the other file format, one rank at a time:
    a rank's weights and moments are fetched, written and released before the next rank is read (read whole, it
    held every rank at once)."""
    whole = source.whole
    if to not in ("xser", "torch"):
        raise CheckpointError(f"format {to!r} is not supported; use xser or torch")
    pp, tp = whole.pipeline_parallel, whole.tensor_parallel
    with staged_iteration(out, whole.iteration) as tmp:
        for p, row in enumerate(whole.grid):
            for t, state in enumerate(row):
                roles = _lazy(state)
                values = {id(x): _fetch(source, p, t, name, role) for (name, role), x in roles.items()}
                filled = _replace(state, lambda x, v=values: v.get(id(x), x))  # type: ignore[misc]
                write_rank_folder(filled, tmp, tp_rank=t, pp_rank=p, pp_size=pp, fmt=to)
                del values, filled
                for name in list(state["model"]):
                    source.release(p, t, name)
        return commit_save(tmp, out, whole.iteration, ranks=RankInfo(world_size=tp * pp, tp_size=tp, pp_size=pp),
                           fmt=to, layout=PipelineLayout.of_manifest(whole.found.manifest))


def _fetch(source: stream.Source, p: int, t: int, name: str, role: str) -> torch.Tensor:
    if role == "weight":
        return source.weight(p, t, name)
    assert source.moment is not None, "a lazily read source fetches its moments"
    return source.moment(p, t, name, role)
