"""Paired collectives for tensor parallelism, each an autograd.Function plus a wrapper.

Every wrapper's one-line docstring states `fwd: X | bwd: Y | dim: last` and a test holds it to
the code. The process group is always an argument, never a default. The sharded tensor dim is
the last one (hidden or vocab), as in Megatron's column/row-parallel layers; the sequence-parallel mappings
(`dim: sequence`) split dim 1 of our batch-first (B, S, H) tensors instead (Megatron's [S, B, H] splits dim 0).
When the group has one rank each mapping is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron_hpc.parallel.collectives import reduce_scatter_single


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _split(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's contiguous shard of `x` along `dim`."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} ({x.shape[dim]}) is not divisible by the group size {size}")
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's shard, concatenated along `dim` in rank order."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


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
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.group, -1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, ctx.group, -1), None


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


# Sequence parallelism (Korthikanti et al. 2022): dim 1 of batch-first (B, S, H) tensors.
_SEQ = 1


def _reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    # reduce_scatter_tensor on every backend, gloo included although an all-reduce is faster there (the distributed
    # optimizer's benchmark): SP runs on the CPU only in tests, which then exercise the NCCL path's collective.
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[_SEQ] % size:
        raise ValueError(f"sequence dim {x.shape[_SEQ]} is not divisible by the group size {size}")
    # reduce_scatter_tensor splits dim 0: move the sequence there and back.
    xt = x.transpose(0, _SEQ).contiguous()
    out = torch.empty((xt.shape[0] // size, *xt.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, xt, op=dist.ReduceOp.SUM, group=group)
    return out.transpose(0, _SEQ).contiguous()


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split(x, group, _SEQ)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.group, _SEQ), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group, _SEQ)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Each rank's consumer (a column-parallel matmul) saw the full sequence and produced a partial grad of it.
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.group, _SEQ), None


def scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """fwd: split | bwd: all-gather | dim: sequence"""
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """fwd: all-gather | bwd: reduce-scatter | dim: sequence"""
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """fwd: reduce-scatter | bwd: all-gather | dim: sequence"""
    return _ReduceScatterToSequence.apply(x, group)


class _SequenceGatherLinear(torch.autograd.Function):
    """all-gather along the sequence, then x W^T + b; keeps the sequence shard for backward, not the gathered input,
    and gathers it again there. Megatron's sequence-parallel linear does the same, and Korthikanti et al.'s
    activation count (34/t per layer) assumes it: saving the gathered input would keep the QKV and MLP inputs whole
    on every TP rank."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(_gather(x, group, _SEQ), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        # Under autocast the forward's matmul ran in 16 bits and `grad` is 16-bit: compute in its dtype, then hand
        # each input its own dtype back, as autocast's cast nodes would.
        full = _gather(x, ctx.group, _SEQ).to(grad.dtype)
        grad_x = _reduce_scatter_seq(grad.matmul(weight.to(grad.dtype)), ctx.group).to(x.dtype)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_w = flat_grad.t().mm(full.reshape(-1, full.shape[-1])).to(weight.dtype)
        grad_b = flat_grad.sum(dim=0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def sequence_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: ProcessGroup) -> torch.Tensor:
    """linear(gather_from_sequence_region(x), weight, bias), keeping only the sequence shard for backward."""
    return _SequenceGatherLinear.apply(x, weight, bias, group)
