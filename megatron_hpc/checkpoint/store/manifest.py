"""manifest.json: the mesh of a checkpoint and the size and crc32 of every file in it.

Written by global rank 0 after every writer finished and before the folder is renamed and the
tracker is updated, so a folder with a manifest is complete. Loading checks each file it reads
against it; a truncated or altered file raises CheckpointError naming the file.

Version 2 records zlib's crc32 (computed while the bytes stream through, file_io.py); version 1 recorded sha256,
three times slower to compute. Both versions load.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_hpc.atomic_write import write_json_atomic
from megatron_hpc.checkpoint.store.paths import MANIFEST
from megatron_hpc.errors import CheckpointAccessError, CheckpointError

MANIFEST_VERSION = 2
READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True, kw_only=True, slots=True)
class FileRecord:
    size: int
    """Bytes."""
    crc32: int | None = None
    """zlib.crc32 of the whole file (version 2)."""
    sha256: str | None = None
    """Hex digest of the whole file (version 1)."""

    def to_json(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {"size": self.size}
        if self.crc32 is not None:
            out["crc32"] = f"{self.crc32:08x}"
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out

    @classmethod
    def from_json(cls, data: dict) -> FileRecord:
        crc, sha = data.get("crc32"), data.get("sha256")
        if crc is None and sha is None:
            raise ValueError("a file record has neither crc32 nor sha256")
        return cls(size=int(data["size"]), crc32=None if crc is None else int(str(crc), 16),
                   sha256=None if sha is None else str(sha))


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    iteration: int
    """Optimizer steps taken when the checkpoint was written."""
    format: str
    """xser or torch."""
    tensor_parallel: int
    """TP size of the run that wrote it; loading needs the same."""
    pipeline_parallel: int = 1
    """PP size of the run that wrote it (one mp_rank_XX_YYY folder per TP x PP rank); loading needs the same.
    Manifests written before pipeline parallelism have none: 1."""
    virtual_pipeline: int = 1
    """Model chunks per pipeline rank; with the two below it decides which layers each pipeline rank's file holds."""
    pipeline_first_stage_layers: int = 0
    """Layers on the first stage when uneven (0: even split)."""
    pipeline_last_stage_layers: int = 0
    """Layers on the last stage when uneven (0: even split)."""
    data_parallel: int
    """DP size of the run that wrote it (informational: any DP size can load it)."""
    world_size: int
    """Ranks of the run that wrote it."""
    files: dict[str, FileRecord] = field(default_factory=dict)
    """Every file of the checkpoint, by path relative to its iteration folder."""


def write_json_durably(path: Path, data: object) -> None:
    """Write JSON atomically and fsync it before the rename (atomic_write.py)."""
    write_json_atomic(path, data, durable=True, indent=1, sort_keys=True)


def write_manifest(ckpt_dir: Path, manifest: Manifest) -> None:
    data = asdict(manifest)
    data["files"] = {rel: rec.to_json() for rel, rec in manifest.files.items()}
    data["manifest_version"] = MANIFEST_VERSION
    write_json_durably(ckpt_dir / MANIFEST, data)


def read_manifest(ckpt_dir: Path) -> Manifest:
    """The manifest of a checkpoint folder; CheckpointError when it is missing or malformed."""
    path = ckpt_dir / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="ascii"))
        if data.pop("manifest_version") not in READABLE_VERSIONS:
            raise ValueError(f"unknown manifest_version (this version reads {READABLE_VERSIONS})")
        files = {str(k): FileRecord.from_json(v) for k, v in data.pop("files").items()}
        return Manifest(iteration=int(data["iteration"]), format=str(data["format"]),
                        tensor_parallel=int(data["tensor_parallel"]), data_parallel=int(data["data_parallel"]),
                        world_size=int(data["world_size"]), files=files,
                        pipeline_parallel=int(data.get("pipeline_parallel", 1)),
                        virtual_pipeline=int(data.get("virtual_pipeline", 1)),
                        pipeline_first_stage_layers=int(data.get("pipeline_first_stage_layers", 0)),
                        pipeline_last_stage_layers=int(data.get("pipeline_last_stage_layers", 0)))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing, so {ckpt_dir} is incomplete (a save did not finish); "
                              "load an earlier checkpoint or delete the folder") from None
    except PermissionError as exc:
        raise CheckpointAccessError(path, exc) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not a valid manifest ({type(exc).__name__}: {exc}); "
                              "the checkpoint is damaged, load an earlier one") from None
