"""A small real code corpus, built offline from this Python's own standard library sources.

CodeParrot (the corpus of Megatron's GPT-2 code examples) is one JSON line per Python file with
its repository, path and content; here the files are `Lib/**/*.py` of the running interpreter,
in sorted path order, so the same Python version always gives the same corpus. Test packages,
files over `max_file_bytes` and files that are not UTF-8 are left out, and the corpus stops
before `max_bytes` of source text.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from megatron_hpc.errors import DataError

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
DEFAULT_MAX_BYTES = 4 * 2**20
DEFAULT_MAX_FILE_BYTES = 128 * 2**10


def stdlib_sources(root: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """Every `.py` under the stdlib root (or `root`), sorted by relative path, test dirs skipped."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise DataError(f"standard library sources not found at {base}; pass a directory of .py files")
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        found.extend(Path(dirpath, f).relative_to(base) for f in filenames if f.endswith(".py"))
    for rel in sorted(found, key=lambda p: p.as_posix()):
        yield base / rel


def write_demo_corpus(
    path: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> tuple[int, int]:
    """Write the corpus as JSONL (keys repo_name, path, license, size, text); returns (files, bytes)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    files = total = 0
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for source in stdlib_sources(base):
            data = source.read_bytes()
            if not data.strip() or len(data) > max_file_bytes:
                continue
            if total + len(data) > max_bytes:
                break
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            record = {"repo_name": f"python/cpython@{sys.version_info.major}.{sys.version_info.minor}",
                      "path": "Lib/" + source.relative_to(base).as_posix(), "license": "PSF-2.0",
                      "size": len(data), "text": text}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            files += 1
            total += len(data)
    if not files:
        raise DataError(f"no usable .py files under {base} (max_file_bytes={max_file_bytes}, max_bytes={max_bytes})")
    os.replace(tmp, out)
    return files, total
