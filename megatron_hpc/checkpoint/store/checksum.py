"""crc32 of checkpoint bytes: zlib's checksum (the manifest's and the zip records'), from the fastest code at hand.

ISA-L's crc32 (the `isal` package) folds 64 bytes at a time with carry-less multiplies: 10.9 GiB/s on the CI VM
against zlib 1.2.13's 3.3 GiB/s (benchmarks/RESULTS.md, issue 15), which made the checksum a quarter of a load's CPU
time. Same polynomial, same initial value and the same running-value argument, so every checksum we write or check
is bit for bit zlib.crc32's: manifests, old checkpoints and torch_xla's reader are unaffected. Like zlib.crc32 it
releases the GIL for buffers over 5 KiB (isal >= 1.2), so the loader's threads checksum in parallel.

isal is a dependency (setup.cfg); zlib stays the fallback for an environment installed before it, which then
only runs slower.
"""

from __future__ import annotations

from collections.abc import Callable

_combine: Callable[[int, int, int], int] | None
try:
    from isal.isal_zlib import crc32 as _crc32
    from isal.isal_zlib import crc32_combine as _combine
    IMPLEMENTATION = "isal"
except ImportError:  # an environment installed before isal was a dependency: same values, slower
    from zlib import crc32 as _crc32
    _combine = None  # Python's zlib has none; computing a crc32 again is then cheaper than combining in Python
    IMPLEMENTATION = "zlib"

CAN_COMBINE = _combine is not None
"""Whether crc32_combine is at hand (with isal): one pass over a record's bytes then gives the record's crc32 and
the file's (store/zip_crc.py, file_io.py)."""


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib.crc32(data, value): the running crc32 of `value`'s bytes followed by `data`."""
    return _crc32(data, value)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine: the crc32 of A followed by B from crc32(A), crc32(B) and len(B). Only with CAN_COMBINE."""
    assert _combine is not None, "crc32_combine needs isal (CAN_COMBINE)"
    return _combine(crc1, crc2, len2)
