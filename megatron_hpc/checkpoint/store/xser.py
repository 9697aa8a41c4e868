"""Read and write torch_xla's xser layout (and plain torch.save files) without importing torch_xla.

Format (shared/reference/neuron-xla.md 1.1): the main file is a torch.save zip of the object with
every tensor replaced by `torch_xla.utils.serialization.TensorReference(tid)`; each tensor is a
torch.save of one CPU tensor in `<main>.tensors/tensor_<tid>.pt`. tids follow the traversal order
of torch_xla's `for_each_instance` (depth first: dict keys and values in insertion order, list and
tuple items in order); tuples are written as lists and dict subclasses as dicts, as the real
rewrite does; a tensor reached twice (aliased) is stored once.

Differences from the real saver, on purpose:
- it replaces every plain tensor, on any device; the real one only XLA tensors, leaving CPU tensors
  (RNG states) inline. Our reader handles both.
- Parameters and objects other than dict/list/tuple/str/bytes/numbers/None raise CheckpointError
  (the real one would pickle them inline; we could not read them back safely).

Reading never runs code from the file: `torch.load(weights_only=True)` with exactly one extra
allowed global, our TensorReference stub. Its `__module__` is torch_xla's, so the pickled global
is `torch_xla.utils.serialization\\nTensorReference` and the real `xser.load` reads our files.
"""

from __future__ import annotations

import os
import pickle
import types
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.store.file_io import (
    TensorLayout,
    Written,
    read_tensor_into,
    read_torch_file,
    safe_load,
    tensor_layout,
    write_torch_file,
)
from megatron_hpc.checkpoint.store.manifest import FileRecord
from megatron_hpc.checkpoint.store.paths import tensor_file, tensors_dir
from megatron_hpc.errors import CheckpointAccessError, CheckpointError

_XLA_MODULE = "torch_xla.utils.serialization"
_SCALARS = (str, bytes, int, float, bool, type(None))


class TensorReference:
    """Stand-in for torch_xla.utils.serialization.TensorReference: only `tid`, an int."""

    def __init__(self, tid: int):
        self.tid = tid

    def __repr__(self) -> str:
        return f"TensorReference({self.tid})"


TensorReference.__module__ = _XLA_MODULE


class _XserPickler(pickle._Pickler):
    """Pickles our stub class as the global `torch_xla.utils.serialization TensorReference`.

    The stock pickler would import torch_xla to check that the global resolves; we write the
    protocol-2 GLOBAL opcode ourselves instead (the pure-Python pickler lets us override it).
    """

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is TensorReference:
            self.write(pickle.GLOBAL + f"{_XLA_MODULE}\nTensorReference\n".encode("ascii"))
            self.memoize(obj)
            return
        super().save_global(obj, name)


PICKLE_MODULE = types.ModuleType("megatron_hpc_xser_pickle")
"""torch.save's `pickle_module` for a main file: writes TensorReference as torch_xla's global (writers that build
their own reference data, such as the test fixtures that write as torch_xla does, pass it too)."""
PICKLE_MODULE.Pickler = _XserPickler  # type: ignore[attr-defined]

OnWritten = Callable[[Path, Written], None]
"""Told about every file written (size and crc32); the saver collects them for the manifest."""


def _ignore(path: Path, written: Written) -> None:
    pass


def _compact_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning just its elements (torch.save of a view writes the whole storage)."""
    t = t.detach().cpu()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def rewrite(obj: Any, *, where: str = "") -> tuple[Any, list[torch.Tensor]]:
    """The object with each tensor replaced by a TensorReference, and the tensors in tid order."""
    tensors: list[torch.Tensor] = []
    seen: dict[int, Any] = {}

    def walk(value: Any, path: str) -> Any:
        if id(value) in seen:
            return seen[id(value)]
        if isinstance(value, torch.nn.Parameter) or (isinstance(value, torch.Tensor)
                                                     and type(value) is not torch.Tensor):
            raise CheckpointError(f"{path or 'the object'} is a {type(value).__name__}; store plain tensors "
                                  "(module.state_dict() gives them), not Parameters or tensor subclasses")
        if type(value) is torch.Tensor:
            seen[id(value)] = TensorReference(len(tensors))
            tensors.append(value)
            return seen[id(value)]
        if isinstance(value, dict):
            out: dict[Any, Any] = {}
            seen[id(value)] = out
            for key, item in value.items():
                out[walk(key, path)] = walk(item, f"{path}.{key}" if path else str(key))
            return out
        if isinstance(value, (list, tuple)):
            out_list: list[Any] = []
            seen[id(value)] = out_list
            for i, item in enumerate(value):
                out_list.append(walk(item, f"{path}[{i}]"))
            return out_list
        if isinstance(value, _SCALARS):
            return value
        raise CheckpointError(f"{path or 'the object'} is a {type(value).__name__}, which a checkpoint cannot "
                              "hold; convert it to dicts, lists, numbers, strings or tensors")

    return walk(obj, where), tensors


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An object taken apart for writing later: `rewrite`'s references and host copies of its tensors that nothing
    else holds (the optimizer updates the live tensors in place while an asynchronous save writes these)."""

    ref_data: Any
    tensors: list[torch.Tensor]


def snapshot(obj: Any, *, into: Snapshot | None = None) -> Snapshot:
    """`obj` copied to host memory, tensor by tensor; written later, it gives the same bytes as writing `obj` now.

    `into`: an earlier snapshot nothing reads any more; its tensors of the same shape and dtype are overwritten
    instead of allocating new ones (fresh memory costs a page fault per 4 KiB: about 5x the copy itself).
    """
    ref_data, tensors = rewrite(obj)
    copies = []
    old = into.tensors if into is not None and len(into.tensors) == len(tensors) else []
    for i, t in enumerate(tensors):
        if old and old[i].shape == t.shape and old[i].dtype == t.dtype:
            copies.append(old[i].copy_(t.detach()))
            continue
        host = _compact_cpu(t)
        if t.device.type == "cpu" and host.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            host = host.clone()  # .cpu() of a CPU tensor is the tensor itself
        copies.append(host)
    return Snapshot(ref_data=ref_data, tensors=copies)


def _parts(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    return (obj.ref_data, obj.tensors) if isinstance(obj, Snapshot) else rewrite(obj)


IO_THREADS = 4
"""Tensor files written or read at once by one rank: writing, hashing and fsync release the GIL, so the
disk, the checksum and the serialisation overlap. Host memory peaks at about this many tensors."""


def write_xser(obj: Any, main: Path, *, on_written: OnWritten = _ignore, threads: int = IO_THREADS) -> int:
    """Write `obj` as xser at `main` (a new path); returns the number of tensor files.

    Tensors are written one per thread at a time, straight from their memory (file_io.py), so host memory stays
    near what the model already holds (the point of xser); the main file, written last, names them all.
    `obj` may be a Snapshot.
    """
    ref_data, tensors = _parts(obj)
    tensors_dir(main).mkdir(parents=True)

    def write_one(tid: int) -> None:
        path = tensor_file(main, tid)
        on_written(path, write_torch_file(path, _compact_cpu(tensors[tid])))

    _each(write_one, range(len(tensors)), threads=threads)
    on_written(main, write_torch_file(main, ref_data, pickle_module=PICKLE_MODULE))
    return len(tensors)


def _each(fn: Callable[[int], Any], items: Iterable[int], *, threads: int) -> dict[int, Any]:
    """fn over items, `threads` at a time; the first error is raised after the others finished."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return {i: fn(i) for i in items}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(zip(items, pool.map(fn, items), strict=True))


def write_torch(obj: Any, main: Path, *, on_written: OnWritten = _ignore) -> int:
    """Write `obj` (or a Snapshot) as one torch.save file (format torch); same rules on what it may hold."""
    ref_data, tensors = _parts(obj)
    on_written(main, write_torch_file(main, resolve(ref_data, lambda tid: _compact_cpu(tensors[tid]))))
    return 0


def _read(path: Path, files: dict[Path, FileRecord] | None, *, mmap: bool = False) -> Any:
    """Load one torch file; checked against the manifest records when `files` is given."""
    if files is None:
        if mmap:
            try:
                os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
            except OSError as exc:
                raise CheckpointAccessError(path, exc) from None
            return safe_load(path, what=path, mmap=True, allowed=(TensorReference,))
        return read_torch_file(path, allowed=(TensorReference,))
    record = files.get(path)
    if record is None:
        raise CheckpointError(f"{path} is not listed in the checkpoint's manifest; the checkpoint is damaged "
                              "or was modified, load an earlier one")
    return read_torch_file(path, expected=record, allowed=(TensorReference,))


def resolve(ref_data: Any, load: Callable[[int], torch.Tensor]) -> Any:
    """Replace each TensorReference by load(tid); a tid referenced twice gives the same tensor."""
    loaded: dict[int, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if type(value) is TensorReference:
            tid = value.__dict__.get("tid")
            if type(tid) is not int or tid < 0:
                raise CheckpointError(f"a TensorReference has tid {tid!r}, not a non-negative int; "
                                      "the file is damaged")
            if tid not in loaded:
                loaded[tid] = load(tid)
            return loaded[tid]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        return value

    return walk(ref_data)


def read_xser(main: Path, *, files: dict[Path, FileRecord] | None = None, mmap: bool = False,
              into: dict[str, dict[str, torch.Tensor]] | None = None) -> Any:
    """Read an xser main file and its tensors (CPU), ours or torch_xla's; plain torch files too.

    `files`: manifest records by absolute path; every file read must match its record.
    `mmap`: map tensor files instead of reading them (cheap shapes for inspect; no verification).
    `into`: state dicts of tensors that already exist, by the saved object's top-level key
    (`{"model": model.state_dict()}`): each tensor is filled straight from its file and returned in place of a
    fresh tensor (no new memory, no second copy); see plan_in_place for what is checked before the first byte is
    written.
    """
    ref_data = _read(main, files, mmap=mmap)
    targets = {} if into is None or mmap else plan_in_place(main, ref_data, into, files=files, threads=IO_THREADS)

    def load(tid: int) -> torch.Tensor:
        path = tensor_file(main, tid)
        if tid in targets:
            target, layout = targets[tid]
            read_tensor_into(path, target, layout, expected=None if files is None else files[path])
            return target
        tensor = _read(path, files, mmap=mmap)
        if type(tensor) is not torch.Tensor:
            raise CheckpointError(f"{path} holds a {type(tensor).__name__}, not one tensor; the checkpoint "
                                  "is damaged")
        return tensor

    # Read (and verify) the referenced files several at a time, then put them in place.
    wanted = sorted(_referenced_tids(ref_data))
    ready = _each(load, wanted, threads=1 if mmap else IO_THREADS)
    return resolve(ref_data, lambda tid: ready[tid] if tid in ready else load(tid))


def read_references(main: Path, *, files: dict[Path, FileRecord]) -> Any:
    """An xser main file's object with its TensorReferences left in (resolve() puts tensors in their places),
    checked against the manifest records `files`: where a reader that reads each tensor file when asked starts."""
    return _read(main, files)


def _referenced_tids(value: Any) -> set[int]:
    if type(value) is TensorReference:
        tid = value.__dict__.get("tid")
        return {tid} if type(tid) is int and tid >= 0 else set()  # resolve() names a bad one
    if isinstance(value, dict):
        return set().union(*(_referenced_tids(v) for v in value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(_referenced_tids(v) for v in value)) if value else set()
    return set()


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor in a loaded object, in traversal order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from iter_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def _targets(saved: Any, into: dict[str, dict[str, torch.Tensor]], *,
             main: Path) -> dict[int, list[tuple[str, torch.Tensor]]]:
    """tid -> the places of `into` it fills. Each state dict of `into` must have the saved one's keys
    (load_state_dict's strict rule), so a checkpoint of another model is refused before anything is written."""
    out: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for top, state in into.items():
        held = saved.get(top) if isinstance(saved, dict) else None
        keys = set(held) if isinstance(held, dict) else set()
        if keys != set(state):
            missing, extra = sorted(map(str, set(state) - keys)), sorted(map(str, keys - set(state)))
            seen = ([f"lacks {len(missing)} of this run's tensors ({', '.join(missing[:3])})"] if missing else []) + (
                [f"has {len(extra)} this run does not ({', '.join(extra[:3])})"] if extra else [])
            raise CheckpointError(f"{main} does not fit this run: its {top!r} {' and '.join(seen)}; check model.* "
                                  "against the checkpoint's resolved_config (nothing was loaded)")
        for key, target in state.items():
            ref = held[key]
            if type(ref) is torch.Tensor:  # torch_xla leaves CPU tensors inline: read with the main file
                continue
            tid = ref.__dict__.get("tid") if type(ref) is TensorReference else None
            if type(tid) is not int or tid < 0:
                raise CheckpointError(f"{main} holds a {type(ref).__name__} at {top}.{key}, where this run has a "
                                      "tensor; it is damaged or from another program")
            out.setdefault(tid, []).append((f"{top}.{key}", target))
    return out


def _count_references(value: Any, counts: dict[int, int]) -> None:
    if type(value) is TensorReference:
        tid = value.__dict__.get("tid")
        if type(tid) is int:
            counts[tid] = counts.get(tid, 0) + 1
    elif isinstance(value, dict):
        for item in value.values():
            _count_references(item, counts)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _count_references(item, counts)


def _fillable(target: torch.Tensor) -> bool:
    return type(target) is torch.Tensor and target.device.type == "cpu" and target.is_contiguous()


def plan_in_place(main: Path, ref_data: Any, into: dict[str, dict[str, torch.Tensor]], *,
                  files: dict[Path, FileRecord] | None,
                  threads: int = IO_THREADS) -> dict[int, tuple[torch.Tensor, TensorLayout]]:
    """tid -> (existing tensor, file layout) for the tensors of `into` that can be read in place.

    Everything that can be checked without the elements is checked for every file here, before any is written:
    the state dicts' keys, that each file exists, is listed in the manifest with its size, and holds a tensor of the
    target's shape (CheckpointError naming the file and both shapes otherwise). A tensor of another dtype (fp32
    saved, bf16 model), off the CPU, not contiguous, saved in an unusual layout, or referenced from more than one
    place is left to the ordinary read, and the caller's copy converts or places it. The crc32 is checked as the
    bytes pass (read_tensor_into): a damaged file is refused naming it, with the tensors read until then
    overwritten, which is harmless to a caller that aborts on the error, as the trainer's restore does.
    """
    wanted = _targets(ref_data, into, main=main)
    counts: dict[int, int] = {}
    _count_references(ref_data, counts)
    tids = [tid for tid, places in wanted.items() if counts.get(tid) == 1 and len(places) == 1
            and _fillable(places[0][1])]

    def layout(tid: int) -> TensorLayout | None:
        path = tensor_file(main, tid)
        record = None
        if files is not None:
            record = files.get(path)
            if record is None:
                raise CheckpointError(f"{path} is not listed in the checkpoint's manifest; the checkpoint is "
                                      "damaged or was modified, load an earlier one")
        return tensor_layout(path, expected=record, allowed=(TensorReference,))

    layouts = _each(layout, tids, threads=threads)
    plan: dict[int, tuple[torch.Tensor, TensorLayout]] = {}
    for tid in tids:
        (where, target), found = wanted[tid][0], layouts[tid]
        if found is None:
            continue
        if found.shape != target.shape:
            raise CheckpointError(f"{tensor_file(main, tid)} holds {where} of shape {tuple(found.shape)}, this run's "
                                  f"is {tuple(target.shape)}; check model.* against the checkpoint's "
                                  "resolved_config (nothing was loaded)")
        if found.dtype == target.dtype:
            plan[tid] = (target, found)
    return plan
