"""Atomic file writes: the one writer every JSON record, marker, tracker and manifest goes through.

A temporary sibling named after this host and process (two nodes writing the same file on a shared filesystem
never share a temporary), then os.replace: a reader sees the old file or the new one, never half of one.
`durable` adds fsync of the file before the rename, for what must survive a crash (checkpoint manifests and
trackers); the caller fsyncs the folder when the rename itself must survive. A leaf module, like errors.py.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any


def write_text_atomic(path: Path, text: str, *, durable: bool = False, encoding: str = "utf-8") -> Path:
    """Replace `path` with `text` atomically; the temporary is removed if anything fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding=encoding) as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json_atomic(path: Path, data: Any, *, durable: bool = False, indent: int | None = 2,
                      sort_keys: bool = False) -> Path:
    """Replace `path` with `data` as JSON (and a final newline) atomically."""
    return write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n", durable=durable)
