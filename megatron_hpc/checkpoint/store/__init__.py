"""The Megatron layout on disk: where a checkpoint's files go (paths), what a save writes and checks (manifest,
xser and torch files, crc32, the restricted unpickler), saving (in phases, atomically, or on a thread) and loading,
what a rank's state holds (contents) and whether a checkpoint fits a run (compat).

The room below the other two: conversion/ and foreign/ read and write through it, and it imports neither.
Everything outside the room imports from here, never from a module inside it.

Each name is imported on first use (PEP 562 `__getattr__`) from its module in _EXPORTS: the launcher (run_status
reads the tracker) and `submit`'s pre-queue check (compat) import this face and stay torch-free, while saving and
loading need torch. tests/unit/test_checkpoint_rooms.py reads _EXPORTS to check who imports what.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = ("paths",)
"""Exported whole: the pure path functions and file names, used as `paths.X`."""

_EXPORTS = {
    "async_save": ("AsyncSave",),
    "compat": ("PipelineLayout", "check_before_queue", "check_finetune_source", "foreign_message", "is_foreign",
               "reshard_out"),
    "contents": ("Progress", "build_state_dict", "read_progress", "read_rng", "saved_global_batch"),
    "file_io": ("data_records", "read_torch_file", "safe_load", "tensor_layout", "verify_file"),
    "loader": ("FoundCheckpoint", "find_checkpoint", "load_checkpoint", "read_shard"),
    "manifest": ("Manifest", "read_manifest"),
    "paths": ("iteration_dir", "parse_tracker", "tracker_file"),
    "ranks": ("RankInfo",),
    "saver": ("commit_save", "save_checkpoint", "write_rank_folder"),
    "staging": ("staged_iteration",),
    "xser": ("Snapshot", "iter_tensors", "read_references", "read_xser", "resolve"),
    "zip_crc": ("torch_crc_off",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [*_MODULES, *_HOME]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # later lookups find it without coming back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
