"""glibc's malloc settings that keep freed blocks in the process for reuse, shared by the CPU trainer
(parallel/device.py keep_freed_memory) and the offline convert (checkpoint/conversion/host_memory.py). No torch.

By default glibc serves each block above its mmap threshold with a fresh mapping and unmaps it on free, so a
program that frees and allocates the same large sizes over and over (a training step's activations, a convert's
read boxes and output pieces) has the kernel fault in and zero every page again. With mmap off (M_MMAP_MAX 0) and
the trim threshold at its maximum, freed blocks stay in the heap and the next allocation of that size reuses them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters, glibc's malloc.h
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536  # glibc's starting values (malloc.c)


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


@functools.cache
def _trim():  # type: ignore[no-untyped-def]
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def keep_freed_blocks() -> bool:
    """Turn glibc's mmap for large blocks off and its trim threshold to the maximum (the module docstring); False
    where it cannot (not glibc). Setting them also stops glibc's dynamic mmap threshold for the process."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def default_freed_blocks() -> None:
    """Back to glibc's starting mmap and trim settings; a no-op off glibc."""
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)


def give_back_freed() -> None:
    """Return the heap's free pages to the OS (glibc's malloc_trim); a no-op where the C library has none."""
    trim = _trim()
    if trim is not None:
        trim(0)
