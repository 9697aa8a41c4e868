"""Handing freed host memory back to the OS while an offline tool (`ckpt convert`, `ckpt reshard`) frees weights.

glibc serves allocations below its mmap threshold from the heap, and raises that threshold (up to 32 MiB) each
time a larger mapped block is freed, so after the first freed tensor most tensors of a GPT land in the heap. Freed,
they stay in the process (and in its RSS) until malloc_trim returns the free pages. A reshard that frees the old
weights as it makes the new ones only lowers its peak if those pages really go back.

The other way round, while a convert runs (reused_memory): blocks above the mmap threshold are kept in the heap,
so that the next block of the same size reuses their pages instead of faulting fresh ones in.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Iterator


@functools.cache
def _trim():  # type: ignore[no-untyped-def]
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def give_back_freed() -> None:
    """Return the heap's free pages to the OS (glibc's malloc_trim); a no-op where the C library has none."""
    trim = _trim()
    if trim is not None:
        trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters, glibc's malloc.h
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536  # glibc's defaults (malloc.c)


@functools.cache
def _mallopt():  # type: ignore[no-untyped-def]
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (AttributeError off glibc: musl, macOS)
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


@contextlib.contextmanager
def reused_memory() -> Iterator[bool]:
    """Inside, glibc keeps freed blocks in the heap for the next allocation instead of unmapping them; after,
    its defaults are back and the free pages are given back (give_back_freed). Yields False where it cannot (not
    glibc): nothing changes then.

    Why: a convert allocates and frees the same sizes over and over (each unit's read boxes, torch's storage for
    every chunk it loads, each output rank's pieces). Above glibc's mmap threshold each is a fresh mapping that the
    kernel faults in and zeroes 4 KiB at a time, more CPU than the copy that fills it: 1.2 M page faults for a
    2.67 GiB torch_dist source (benchmarks/RESULTS.md, issue 27). Kept in the heap they are reused; the peak RSS
    stays what the convert holds at once (stream.reshard trims after each output rank). Setting them also stops
    glibc's dynamic mmap threshold for the rest of the process; the values restored are its starting ones.
    """
    mallopt = _mallopt()
    if mallopt is None or not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        yield False
        return
    try:
        yield True
    finally:
        mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        give_back_freed()
