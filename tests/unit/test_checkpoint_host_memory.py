"""reused_memory (the convert's malloc setting): inside, a large block comes from the heap and stays there once
freed, for the next one to reuse; after, glibc's defaults are back and such a block is mapped on its own again.
Read from glibc's own accounting (mallinfo2), which does not depend on where the heap happens to lie."""

from __future__ import annotations

import ctypes

import torch

from megatron_hpc.checkpoint.conversion import reused_memory

_BLOCK = 64 << 20  # above glibc's largest dynamic mmap threshold (32 MiB): mapped on its own by default


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _info() -> _MallInfo2:
    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = _MallInfo2
    return fn()


def test_large_blocks_stay_in_the_heap_inside_and_are_mapped_after() -> None:
    with reused_memory() as applied:
        before = _info()
        block = torch.empty(_BLOCK, dtype=torch.uint8)
        held = _info()
        del block
        freed = _info()
    assert applied is True  # glibc (CI): the setting took
    assert held.hblkhd == before.hblkhd  # not a mapping of its own: the heap's
    assert held.uordblks >= before.uordblks + _BLOCK
    assert freed.arena >= held.arena - (1 << 20) and freed.fordblks >= _BLOCK  # kept for the next block, not trimmed
    # Defaults back: a block larger than any free chunk the heap keeps is mapped on its own. (A freed block that is
    # not at the heap's top cannot be trimmed and serves a request of its size whatever the settings: in a process
    # that ran other tests first, the same 64 MiB came from the heap again.)
    after = _info()
    size = after.fordblks + _BLOCK
    block = torch.empty(size, dtype=torch.uint8)
    assert _info().hblkhd >= after.hblkhd + size
    del block
