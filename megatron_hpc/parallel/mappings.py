"""Paired collectives for tensor parallelism, each an autograd.Function plus a wrapper.

Every wrapper's one-line docstring states `fwd: X | bwd: Y | dim: last` and a test holds it to
the code. The process group is always an argument, never a default. The sharded tensor dim is
the last one (hidden or vocab), as in Megatron's column/row-parallel layers.
When the group has one rank each mapping is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _split_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[-1] % size:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the group size {size}")
    rank = dist.get_rank(group)
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if dist.get_world_size(ctx.group) == 1:
            return grad, None
        # clone: all_reduce works in place and autograd may hand the same grad to another node
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        if dist.get_world_size(group) == 1:
            return x
        # clone: all_reduce works in place and x may be saved for another backward
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """fwd: identity | bwd: all-reduce | dim: last"""
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """fwd: all-reduce | bwd: identity | dim: last"""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """fwd: split | bwd: all-gather | dim: last"""
    return _ScatterToTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """fwd: all-gather | bwd: split | dim: last"""
    return _GatherFromTP.apply(x, group)
