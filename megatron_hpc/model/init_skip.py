"""Skip the random initialisation of a model whose weights a checkpoint is about to replace.

Megatron's `--use-cpu-initialization` draws every full weight on the host before sharding it, and a
resumed run pays for it (time, and host memory at scale) only to overwrite it with the checkpoint: the
reference's users remove the flag by hand before resuming. Here, when a checkpoint will be loaded,
the model is built inside `skip_random_init()`: the in-place random fills (`normal_`, `uniform_`, ...)
return their tensor untouched, so no random numbers are drawn, while deterministic buffers (rotary
tables) are computed as usual. Loading with strict keys then sets every parameter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

_RANDOM_FILLS = frozenset({
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.bernoulli_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
})


class _SkipRandomFills(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _RANDOM_FILLS:
            return args[0]
        return func(*args, **(kwargs or {}))


@contextmanager
def skip_random_init(enabled: bool = True) -> Iterator[None]:
    """Within: random in-place fills are no-ops (the memory stays as allocated)."""
    if not enabled:
        yield
        return
    with _SkipRandomFills():
        yield
