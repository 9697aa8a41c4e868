"""Start a file's writeback early: Linux's sync_file_range(SYNC_FILE_RANGE_WRITE), a no-op elsewhere.

Why: a checkpoint file is written through the page cache and fsynced at the end. Left alone, the kernel starts
putting the dirty pages on the disk only past its background threshold (10% of memory here) or after 30 s, so the
fsync waits for most of the file while the CPU idles, and a multi-GiB save can hit the dirty limit and be throttled
mid-write. Asking for writeback of each step as it is written lets the disk work beside torch.save and the caller;
the fsync that makes the file durable is unchanged and then waits for the last step only
(benchmarks/RESULTS.md, issue 27).

SYNC_FILE_RANGE_WRITE does not wait for the pages to reach the disk and promises nothing about durability: it is a
hint. Python's os module has no sync_file_range, so libc's is called through ctypes; where it is missing (not
Linux, or not glibc) or fails, writing goes on as before.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

WRITEBACK_STEP = 32 << 20
"""Bytes written between two requests: large enough that the call's cost (a syscall and a walk of the range) is
nothing, small enough that the disk starts early."""
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


@functools.cache
def _sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing `nbytes` of `fd` from `offset` to the disk, without waiting for it; False
    where it cannot (the caller's fsync still makes the file durable)."""
    fn = _sync_file_range()
    return fn is not None and fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0
