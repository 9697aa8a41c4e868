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
from collections.abc import Iterator

from megatron_hpc.parallel.host_malloc import default_freed_blocks, give_back_freed, keep_freed_blocks

__all__ = ["give_back_freed", "reused_memory"]


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
    if not keep_freed_blocks():
        yield False
        return
    try:
        yield True
    finally:
        default_freed_blocks()
        give_back_freed()
