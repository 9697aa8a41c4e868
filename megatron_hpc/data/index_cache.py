"""Index caches on disk, shared by GPTDataset and BlendedDataset: Megatron's names, one builder per cache.

Megatron names every cache file `{md5}-{class}-{split}-{suffix}`, the md5 being that of the dataset's description
JSON, which is stored next to the arrays as `...-description.txt` (shared/reference/megatron-and-launchers.md 2.4),
so caches built by either tool are found by the other.

Megatron lets global rank 0 build and the others wait at a barrier. Here any process may build: it takes a file
lock next to the files, writes each file under a temporary name and renames it into place, the arrays first and
the description last, so a reader that finds the description finds whole arrays. The others wait on the lock and
then load what it wrote. A cache whose files do not load or do not fit is rebuilt, not trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO, TypeVar

import filelock
import numpy as np

from megatron_hpc.errors import DataError

DESCRIPTION = "description.txt"
T = TypeVar("T")
Expected = Mapping[str, tuple[tuple[int, ...], Sequence[np.dtype]]]
"""suffix -> (shape, accepted dtypes) of each array file."""


def cache_file_paths(directory: str, *, description: str, class_name: str, split_name: str,
                     suffixes: Sequence[str]) -> dict[str, str]:
    """`{directory}/{md5(description)}-{class_name}-{split_name}-{suffix}` for each suffix, keyed by suffix."""
    digest = hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()
    return {s: os.path.join(directory, f"{digest}-{class_name}-{split_name}-{s}") for s in suffixes}


def equivalent_cache(directory: str, *, class_name: str, split_name: str, identifiers: Mapping[str, Any],
                     ignore: Sequence[str], suffixes: Sequence[str]) -> tuple[dict[str, str], str] | None:
    """Another cache in `directory` whose description equals `identifiers` except for the `ignore` keys: its file
    paths and description text, or None.

    The md5 in a cache's name covers keys that do not change the arrays: megatron-core puts the tokenizer's own
    unique_identifiers (class, vocab paths, options) into the description, so a cache Megatron built for the same
    data, seed, lengths and split has another name than ours. Comparing the descriptions themselves finds it.
    """
    want = {k: v for k, v in json.loads(json.dumps(identifiers)).items() if k not in ignore}  # tuples as lists
    tail = f"-{class_name}-{split_name}-{DESCRIPTION}"
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(tail))
    except OSError:
        return None
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            theirs = json.loads(text)
        except (OSError, ValueError):
            continue
        if isinstance(theirs, dict) and {k: v for k, v in theirs.items() if k not in ignore} == want:
            stem = path[: -len(DESCRIPTION)]
            return {s: stem + s for s in suffixes}, text
    return None


def _replace_atomically(path: str, write: Callable[[BinaryIO], Any]) -> None:
    """Write `path` through a temporary file in the same directory and rename it into place."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_arrays(paths: Mapping[str, str], *, description: str, expected: Expected) -> dict[str, np.ndarray] | None:
    """The arrays, memory-mapped, if every file exists, the description matches and each array has its expected
    shape and dtype; None otherwise (the caller rebuilds)."""
    if not all(os.path.isfile(p) for p in paths.values()):
        return None
    try:
        with open(paths[DESCRIPTION], encoding="utf-8") as f:
            if f.read() != description:
                return None
        arrays = {}
        for suffix, (shape, dtypes) in expected.items():
            array = np.load(paths[suffix], mmap_mode="r", allow_pickle=False)
            if array.shape != shape or array.dtype not in dtypes:
                return None
            arrays[suffix] = array
    except (OSError, ValueError, EOFError, UnicodeDecodeError):
        return None
    return arrays


def write_arrays(paths: Mapping[str, str], *, description: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Each array to its `.npy` file, then the description: every file lands by an atomic rename."""
    for suffix, array in arrays.items():
        _replace_atomically(paths[suffix], lambda f, a=array: np.save(f, a, allow_pickle=False))
    _replace_atomically(paths[DESCRIPTION], lambda f: f.write(description.encode("utf-8")))


def load_or_build(paths: Mapping[str, str], *, load: Callable[[], T | None], build: Callable[[], T],
                  what: str) -> tuple[T, bool]:
    """(load(), False) if the cache is usable, else (build(), True) under the cache's file lock; `build` writes
    the files. Concurrent callers build once: the others wait on the lock and load."""
    cached = load()
    if cached is not None:
        return cached, False
    description_path = paths[DESCRIPTION]
    directory = os.path.dirname(description_path)
    try:
        os.makedirs(directory or ".", exist_ok=True)
        with filelock.FileLock(description_path[: -len(f"-{DESCRIPTION}")] + ".lock"):
            cached = load()
            if cached is not None:
                return cached, False
            return build(), True
    except OSError as err:
        raise DataError(f"cannot write the {what} index cache in {directory}: {err}; set data.cache_path "
                        f"to a writable directory") from None
