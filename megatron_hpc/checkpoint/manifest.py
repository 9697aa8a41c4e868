"""manifest.json: the mesh of a checkpoint and the size and sha256 of every file in it.

Written by global rank 0 after every writer finished and before the folder is renamed and the
tracker is updated, so a folder with a manifest is complete. Loading checks each file it reads
against it; a truncated or altered file raises CheckpointError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_hpc.checkpoint.paths import MANIFEST
from megatron_hpc.errors import CheckpointError

MANIFEST_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class FileRecord:
    size: int
    """Bytes."""
    sha256: str
    """Hex digest of the whole file."""

    @classmethod
    def of(cls, data: bytes) -> FileRecord:
        return cls(size=len(data), sha256=hashlib.sha256(data).hexdigest())


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    iteration: int
    """Optimizer steps taken when the checkpoint was written."""
    format: str
    """xser or torch."""
    tensor_parallel: int
    """TP size of the run that wrote it; loading needs the same."""
    data_parallel: int
    """DP size of the run that wrote it (informational: any DP size can load it)."""
    world_size: int
    """Ranks of the run that wrote it."""
    files: dict[str, FileRecord] = field(default_factory=dict)
    """Every file of the checkpoint, by path relative to its iteration folder."""


def write_json_durably(path: Path, data: object) -> None:
    """Write JSON to a temporary sibling, fsync it, and os.replace it into place."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "w", encoding="ascii") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_manifest(ckpt_dir: Path, manifest: Manifest) -> None:
    data = asdict(manifest)
    data["manifest_version"] = MANIFEST_VERSION
    write_json_durably(ckpt_dir / MANIFEST, data)


def read_manifest(ckpt_dir: Path) -> Manifest:
    """The manifest of a checkpoint folder; CheckpointError when it is missing or malformed."""
    path = ckpt_dir / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="ascii"))
        if data.pop("manifest_version") != MANIFEST_VERSION:
            raise ValueError("unknown manifest_version")
        files = {str(k): FileRecord(size=int(v["size"]), sha256=str(v["sha256"]))
                 for k, v in data.pop("files").items()}
        return Manifest(iteration=int(data["iteration"]), format=str(data["format"]),
                        tensor_parallel=int(data["tensor_parallel"]), data_parallel=int(data["data_parallel"]),
                        world_size=int(data["world_size"]), files=files)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing, so {ckpt_dir} is incomplete (a save did not finish); "
                              "load an earlier checkpoint or delete the folder") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not a valid manifest ({type(exc).__name__}: {exc}); "
                              "the checkpoint is damaged, load an earlier one") from None


def verify(path: Path, data: bytes, record: FileRecord | None) -> None:
    """Raise CheckpointError naming `path` unless `data` matches its manifest record."""
    if record is None:
        raise CheckpointError(f"{path} is not listed in the checkpoint's manifest; the checkpoint is damaged "
                              "or was modified, load an earlier one")
    if len(data) != record.size:
        raise CheckpointError(f"{path} has {len(data)} bytes but the manifest says {record.size} "
                              "(truncated or altered); load an earlier checkpoint")
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.sha256:
        raise CheckpointError(f"{path} has sha256 {digest[:16]}... but the manifest says "
                              f"{record.sha256[:16]}... (altered); load an earlier checkpoint")
