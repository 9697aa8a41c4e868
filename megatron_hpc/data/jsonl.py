"""Reading JSONL inputs (.jsonl, .jsonl.gz): what preprocessing and tokenizer training both read.

Lines are decoded as UTF-8 in text mode with universal newlines, as Megatron's tools/preprocess_data.py
does (`open(..., 'r', encoding='utf-8')`), with surrogateescape so that a bad byte marks its line instead
of stopping the read; the caller decides what such a line means.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from megatron_hpc.errors import DataError


@contextlib.contextmanager
def open_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[TextIO, object]]:
    """(text lines, raw file) of a .jsonl or .jsonl.gz; `raw.tell()` is the input bytes read so far."""
    path = Path(path)
    try:
        raw = open(path, "rb")  # noqa: SIM115  (closed below)
    except FileNotFoundError:
        raise DataError(f"input {path} not found; pass a .jsonl or .jsonl.gz file") from None
    with raw:
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.name.endswith(".gz") else raw
        text = io.TextIOWrapper(stream, encoding="utf-8", errors="surrogateescape")  # newline=None as Megatron
        try:
            yield text, raw
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise DataError(f"{path}: not a complete gzip file ({exc}); re-compress it or pass the .jsonl") from None
