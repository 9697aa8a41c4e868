"""megatron-core's torch_dist checkpoint folder: recognise it, check it is whole, read it through torch's own
torch.distributed.checkpoint (one process, no process group), never by parsing .distcp files ourselves.

What Megatron-LM's `--ckpt-format torch_dist` (its default) writes into iter_XXXXXXX (megatron-core 0.16.1
dist_checkpointing/serialization.py save, strategies/torch.py, strategies/common.py, core.py):

    metadata.json   {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                    "common_backend_version": 1}, written last (a folder without it is an unfinished save)
    common.pt       torch.save of everything not sharded, by rank 0: args, iteration, checkpoint_version,
                    opt_param_scheduler, the optimizer's param groups and step, content_metadata
    .metadata       torch.distributed.checkpoint's pickled Metadata: each key's global shape, dtype and chunks, and
                    where each chunk lies (storage_data: file name, offset, length)
    __R_T.distcp    the data, one or more files per saving rank; each tensor chunk a torch.save'd tensor, each
                    ShardedObject (rng_state, the distributed optimizer's settings) torch.save'd bytes

Tensors are stored by global key with their global shape: the TP shards of a weight are chunks of one tensor, and
the layers of a stage are a leading layer axis (decoder.layers.* is [num_layers, ...]), so reading a key gives the
whole tensor whatever TP x PP x DP wrote it.

Nothing in the files runs: .metadata is read by a restricted unpickler that knows torch.distributed.checkpoint's
own record classes only, tensors by torch's weights-only loader (FileSystemReader does that), and the bytes of
common.pt and of ShardedObjects by our safe_load (store/file_io.py).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_hpc.checkpoint.foreign.megatron_family import TORCH_DIST_FILES
from megatron_hpc.checkpoint.store import safe_load
from megatron_hpc.errors import CheckpointAccessError, CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

# torch.distributed.checkpoint is imported where it is used: it takes 0.7 s to import (DTensor and its ops), which
# every `ckpt convert` and every importer of the foreign face would pay otherwise.

CONFIG, METADATA, COMMON = TORCH_DIST_FILES
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
"""The only metadata.json megatron-core has written for torch_dist (its CheckpointingConfig defaults)."""
READ_THREADS = 4

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_TORCH_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch._utils", "_get_layout"),
                  # StorageMeta.checkpoint_id is the writer's path, a str or a pathlib path (built, never opened)
                  ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                  ("pathlib", "PureWindowsPath")}


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchDistFolder:
    folder: Path
    common: dict[str, Any]
    """common.pt as written (args, iteration, opt_param_scheduler, optimizer settings, content_metadata, ...)."""
    metadata: Metadata

    @property
    def keys(self) -> dict[str, Any]:
        """Each stored key's record: TensorStorageMetadata (size, properties.dtype, chunks) or BytesStorageMetadata."""
        return self.metadata.state_dict_metadata

    @property
    def content(self) -> dict[str, Any]:
        """Megatron-LM's sharded_state_dict metadata (distrib_optim_sharding_type, ...); empty before mcore 0.13."""
        found = self.common.get("content_metadata")
        return found if isinstance(found, dict) else {}

    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.keys.items() if _is_tensor(v)]

    def object_keys(self) -> list[str]:
        return [k for k, v in self.keys.items() if not _is_tensor(v)]


def _is_tensor(record: Any) -> bool:
    """A TensorStorageMetadata (the other kind, BytesStorageMetadata, has no size)."""
    return hasattr(record, "size") and hasattr(record, "chunks")


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.load of .metadata that builds torch.distributed.checkpoint's records, torch.Size and dtypes, and
    refuses any other global before looking it up."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _TORCH_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name}")


@cache
def _classes() -> tuple[type, type]:
    """(_SafeReader, _Planner): torch's FileSystemReader with .metadata read by _MetadataUnpickler, and its default
    load planner (tensors copied into the tensors given) with ShardedObject bytes kept raw."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return _read_metadata(Path(self.path) / METADATA, Metadata)

    class Planner(DefaultLoadPlanner):
        def __init__(self, raw: dict[str, bytes], offsets: dict[str, tuple[int, ...]] | None = None) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.raw = raw
            self.offsets = offsets or {}
            """Keys asked for a box of the global tensor: where it starts (its size is the tensor given)."""

        def create_local_plan(self) -> LoadPlan:
            if not self.offsets:
                return super().create_local_plan()
            # A box of a key: torch's own resharding (the one a rank loading its shard uses) gives the reads of
            # the saved chunks that overlap it, each copied into the tensor given at its place.
            items = []
            for fqn, obj in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets.get(fqn, (0,) * obj.ndim)),
                                             sizes=obj.size())
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.state_dict[index.fqn] if index.fqn in self.offsets else super().lookup_tensor(index)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.raw[read_item.dest_index.fqn] = value.getvalue()

    return SafeReader, Planner


def _read_metadata(path: Path, kind: type) -> Any:
    try:
        with path.open("rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except PermissionError as exc:
        raise CheckpointAccessError(path, exc) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} has no {METADATA} (torch.distributed.checkpoint's index of the "
                              ".distcp files); the save did not finish, pass another iteration") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, OSError) as exc:
        raise CheckpointError(f"{path} is not torch.distributed.checkpoint metadata ({type(exc).__name__}: "
                              f"{str(exc)[:120]}); it is damaged or of another tool, copy it again") from None
    if not isinstance(metadata, kind):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
                              "metadata; it is damaged, copy it again")
    return metadata


def _check_config(folder: Path) -> None:
    path = folder / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {CONFIG} (megatron-core writes it last, once every rank's files are "
                              "written); the save did not finish, pass another iteration")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except PermissionError as exc:
        raise CheckpointAccessError(path, exc) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not JSON ({exc}); it is damaged, copy it again") from None
    if not isinstance(config, dict) or any(config.get(k) != v for k, v in BACKEND.items()):
        seen = {k: config.get(k) for k in BACKEND} if isinstance(config, dict) else config
        raise CheckpointError(f"{path} says {seen}; only megatron-core's torch_dist format version 1 ({BACKEND}) is "
                              "read: save it with Megatron-LM's --ckpt-format torch_dist, or as --ckpt-format torch "
                              "(--ckpt-convert-format torch --ckpt-convert-save DIR) and convert that")


def _check_files(folder: Path, metadata: Metadata) -> None:
    """Every data file the index names is there (a plain name, inside the folder)."""
    names = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    bad = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
    if bad or not names:
        raise CheckpointError(f"{folder / METADATA} names data files {bad[:2] or 'none'}, not files of this folder; "
                              "it is damaged or of another tool, copy the checkpoint again")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"{folder} has no {missing[0]} ({len(missing)} of its {len(names)} .distcp data files "
                              "missing); the checkpoint is incomplete, copy the missing files or pass another "
                              "iteration")
    # A file cut short (a copy or a save interrupted) is found here from the index's byte ranges, one stat a file,
    # before anything is read or written: torch's reader would fail only at the item past the end, mid-convert.
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    sizes = {n: (folder / n).stat().st_size for n in names}
    short = [(n, sizes[n], ends[n]) for n in names if sizes[n] < ends[n]]
    if short:
        name, size, end = short[0]
        raise CheckpointError(f"{folder / name} has {size:,} bytes but {METADATA} places data up to byte {end:,} "
                              f"({len(short)} of its {len(names)} .distcp data files short); the file is truncated, "
                              "copy the checkpoint again or pass another iteration")


def open_folder(folder: Path) -> TorchDistFolder:
    """The checked folder with its common.pt and index read (no tensor data yet)."""
    _check_config(folder)
    common_path = folder / COMMON
    if not common_path.is_file():
        raise CheckpointError(f"{folder} has no {COMMON} (the args, iteration and optimizer settings rank 0 saves); "
                              "the checkpoint is incomplete, copy common.pt from the run's save folder or pass "
                              "another iteration")
    common = safe_load(common_path, what=common_path)
    if not isinstance(common, dict):
        raise CheckpointError(f"{common_path} holds a {type(common).__name__}, not megatron-core's common state "
                              "dict; it is damaged, copy it again")
    reader, _ = _classes()
    metadata = reader(str(folder)).read_metadata()
    _check_files(folder, metadata)
    return TorchDistFolder(folder=folder, common=common, metadata=metadata)


def _batches(src: TorchDistFolder, request: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """`request` in up to `count` parts of about equal bytes, each key with the others of the .distcp file that holds
    its first chunk, so that each file is read by one load."""
    home: dict[str, str] = {}
    for index, info in (src.metadata.storage_data or {}).items():
        home.setdefault(index.fqn, info.relative_path)
    by_file: dict[str, list[str]] = {}
    for key in request:
        by_file.setdefault(home.get(key, ""), []).append(key)

    def size(key: str) -> int:
        value = request[key]
        return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0

    parts: list[dict[str, Any]] = [{} for _ in range(max(1, min(count, len(by_file))))]
    loads = [0] * len(parts)
    for keys in sorted(by_file.values(), key=lambda ks: -sum(map(size, ks))):
        i = loads.index(min(loads))
        parts[i].update((k, request[k]) for k in keys)
        loads[i] += sum(map(size, keys))
    return parts


def _load(src: TorchDistFolder, request: dict[str, Any], raw: dict[str, bytes],
          offsets: dict[str, tuple[int, ...]]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _classes()
    try:
        dcp.load(request, storage_reader=reader(str(src.folder)), planner=planner(raw, offsets), no_dist=True)
    except CheckpointError:
        raise
    except PermissionError as exc:
        raise CheckpointAccessError(exc.filename or src.folder, exc) from None
    # torch wraps a reader's failure in CheckpointException, which derives from BaseException, not Exception
    # (torch/distributed/checkpoint/api.py): without naming it, a damaged .distcp escaped as a traceback.
    except (Exception, CheckpointException) as exc:
        failures = getattr(exc, "failures", None) or {}
        cause = next(iter(failures.values()), (exc, None))[0]  # {rank: (exception, trace)}
        if isinstance(cause, PermissionError):
            raise CheckpointAccessError(cause.filename or src.folder, cause) from None
        # the first sentence: torch's weights-only refusal goes on for lines about torch.load's arguments
        text = str(cause).strip().splitlines()[0].split(". ")[0][:300] if str(cause).strip() else ""
        raise CheckpointError(f"torch.distributed.checkpoint could not read {src.folder} "
                              f"({type(cause).__name__}{': ' + text if text else ''}); a .distcp file is damaged, "
                              "copy the checkpoint again") from None


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a part of a key's global tensor."""


def read(src: TorchDistFolder, keys: Iterable[str], *, boxes: dict[str, Box] | None = None
         ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, objects) of `keys`: each tensor at its global shape and saved dtype (or only the part `boxes` names
    for it, say one layer of a stacked key), each ShardedObject key's value (the list of its shards' data
    megatron-core saved) unpickled by safe_load.

    The .distcp files are read by up to READ_THREADS loads side by side (each its own files): torch's reader copies
    every chunk twice (out of the file into a storage, then into the tensor asked for), one file after another, and
    those copies, not the disk, bound it (benchmarks/convert_torch_dist_cpu.py)."""
    boxes = boxes or {}
    tensors: dict[str, torch.Tensor] = {}
    request: dict[str, Any] = {}
    for key in keys:
        record = src.keys[key]
        if _is_tensor(record):
            size = boxes[key][1] if key in boxes else record.size
            tensors[key] = request[key] = torch.empty(size, dtype=record.properties.dtype)
        else:
            request[key] = io.BytesIO()
    offsets = {key: box[0] for key, box in boxes.items() if key in tensors}
    assert not offsets or len(tensors) == len(request), "a load with boxes plans tensors only (Planner)"
    raw: dict[str, bytes] = {}
    parts = _batches(src, request, min(READ_THREADS, os.cpu_count() or 1)) if request else []
    with warnings.catch_warnings():  # one process on purpose: no_dist says so, torch warns anyway
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if len(parts) == 1:
            _load(src, parts[0], raw, offsets)
        elif parts:
            with ThreadPoolExecutor(len(parts)) as pool:
                for done in [pool.submit(_load, src, part, raw, offsets) for part in parts]:
                    done.result()  # the first failure, re-raised here
    objects = {key: safe_load(io.BytesIO(data), what=src.folder / f"{key} (in a .distcp file)")
               for key, data in raw.items()}
    return tensors, objects
