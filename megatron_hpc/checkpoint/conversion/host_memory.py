"""Handing freed host memory back to the OS while an offline tool (`ckpt convert`, `ckpt reshard`) frees weights.

glibc serves allocations below its mmap threshold from the heap, and raises that threshold (up to 32 MiB) each
time a larger mapped block is freed, so after the first freed tensor most tensors of a GPT land in the heap. Freed,
they stay in the process (and in its RSS) until malloc_trim returns the free pages. A reshard that frees the old
weights as it makes the new ones only lowers its peak if those pages really go back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


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
