"""Compile fingerprints: is the compile phase needed at all? Pure, apart from the markers' files.

The graphs a run compiles depend on the model's shape, the mesh, the batch shapes, the precision,
whether torch.compile is on, the platform, the compiler and its flags — and on nothing else (not the
learning rate, the seed, the data or the number of steps). A compile phase that succeeded on every node,
each node having published its node-local cache after the compiler (and neuron_parallel_compile) returned
(node.sh, launch/requeue.py record_fingerprint), records the sha256 of exactly those inputs as a marker in
the shared cache, `<root>/megatron-hpc/fingerprints/<sha>.json`; `submit` skips the compile job when that
marker is there. Pruning a launcher root drops the markers (prune.py): they would promise pruned graphs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import socket
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from megatron_hpc.atomic_write import write_json_atomic

MARKER_DIR = "megatron-hpc/fingerprints"

# Where the caches live, and logging switches, do not change a graph.
_ENV_IGNORED = {"NEURON_COMPILE_CACHE_URL", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "PYTHONUNBUFFERED",
                "PYTHONFAULTHANDLER", "MEGATRON_HPC_MAX_REQUEUES"}
_TRAIN_KEYS = ("micro_batch_size", "global_batch_size", "precision", "compile", "compile_backend")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint:
    sha256: str
    inputs: dict[str, Any]
    """What was hashed, kept beside the marker so a person can see why two runs differ."""

    @property
    def short(self) -> str:
        return self.sha256[:12]


def compiler_identity(backend: str) -> str:
    """The compiler that makes the graphs: neuronx-cc's version on XLA, else torch's (without importing it)."""
    names = ("neuronx-cc", "torch-neuronx") if backend == "xla" else ("torch",)
    for name in names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return f"{names[0]} (not installed on the submit host)"


def _flags(env: dict[str, str]) -> dict[str, str]:
    kept = {k: v for k, v in env.items() if k not in _ENV_IGNORED}
    if "NEURON_CC_FLAGS" in kept:  # a --cache_dir names a place, not a compiler option
        tokens = shlex.split(kept["NEURON_CC_FLAGS"])
        kept["NEURON_CC_FLAGS"] = shlex.join(t for t in tokens if not t.startswith("--cache_dir"))
    return dict(sorted(kept.items()))


def compute(config: dict[str, Any], plan: dict[str, Any], *, env: dict[str, str], compiler: str) -> Fingerprint:
    """The fingerprint of a run from its resolved config and plan (their JSON forms) and phase environment."""
    train = config.get("train", {})
    inputs = {
        "model": config.get("model", {}),
        "mesh": {k: plan.get(k) for k in ("num_nodes", "workers_per_node", "tensor_parallel", "pipeline_parallel",
                                          "data_parallel")},
        "train": {k: train.get(k) for k in _TRAIN_KEYS},
        "platform": plan.get("platform"),
        "compiler": compiler,
        "env": _flags(env),
    }
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return Fingerprint(sha256=hashlib.sha256(canonical.encode()).hexdigest(), inputs=inputs)


def marker_path(cache_root: Path, sha256: str) -> Path:
    return cache_root / MARKER_DIR / f"{sha256}.json"


def find(cache_root: Path, sha256: str) -> dict[str, Any] | None:
    """The marker of a fingerprint, or None when no compile phase recorded it (or it is unreadable)."""
    try:
        record = json.loads(marker_path(cache_root, sha256).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def record(cache_root: Path, fp: dict[str, Any], *, run_dir: str, job_id: str | None) -> Path:
    """Write the marker atomically (temp name, rename): a reader sees all of it or nothing."""
    path = marker_path(cache_root, fp["sha256"])
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {**fp, "run_dir": run_dir, "job_id": job_id, "host": socket.gethostname(), "time": time.time()}
    return write_json_atomic(path, body, indent=1, sort_keys=True)


def remove_all(cache_root: Path, *, dry_run: bool = False) -> list[str]:
    """Drop every marker of `cache_root` (after entries were pruned: none proves a warm cache any more).

    Only regular files directly in the marker folder go; a symlinked folder or file is left alone. Returns the
    fingerprints removed (or that would be, with `dry_run`).
    """
    folder = cache_root / MARKER_DIR
    if folder.parent.is_symlink() or folder.is_symlink() or not folder.is_dir():
        return []
    removed = []
    with os.scandir(folder) as it:
        for d in it:
            if d.name.endswith(".json") and not d.name.startswith(".") and d.is_file(follow_symlinks=False):
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(d.path)
                removed.append(d.name[: -len(".json")])
    return sorted(removed)
