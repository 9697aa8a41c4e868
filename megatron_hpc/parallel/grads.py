"""Gradient collectives: data-parallel averaging and the global-norm clip.

After backward, every TP rank of a DP replica holds identical gradients for replicated
parameters (LayerNorms, row biases, positions): the copy_to_tp_region backward already summed
their upstream gradients. So the norm counts a replicated parameter on TP rank 0 only and sums
the sharded ones over the TP group. DP replicas hold identical gradients after the average.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from megatron_hpc.parallel.context import ParallelContext

_BUCKET_NUMEL = 32 * 1024 * 1024
"""Elements per all-reduce bucket (128 MiB in fp32): few calls, bounded extra memory."""


def all_reduce_gradients(params: Iterable[nn.Parameter], *, group: ProcessGroup) -> None:
    """Average .grad over the DP group, in flat buckets, last layers first (as backward produces them)."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    numel = 0
    for grad in reversed(grads):
        if bucket and (numel + grad.numel() > _BUCKET_NUMEL or grad.dtype != bucket[0].dtype):
            _reduce_bucket(bucket, group=group, size=size)
            bucket, numel = [], 0
        bucket.append(grad)
        numel += grad.numel()
    if bucket:
        _reduce_bucket(bucket, group=group, size=size)


def _reduce_bucket(grads: list[torch.Tensor], *, group: ProcessGroup, size: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat.div_(size)  # pre-divide, as the Neuron reference does, to keep sums in range
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def global_grad_norm(params: Iterable[nn.Parameter], *, ctx: ParallelContext) -> torch.Tensor:
    """L2 norm of the full model's gradient; a 0-dim fp32 tensor on the grads' device (no host sync)."""
    squares = []
    for p in params:
        if p.grad is None:
            continue
        if getattr(p, "tensor_parallel", False) or ctx.tp_rank == 0:
            squares.append(p.grad.detach().float().pow(2).sum())
    if not squares:
        raise ValueError("no parameter has a gradient; call backward before the norm")
    total = torch.stack(squares).sum()
    if ctx.tp_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.tp_group)
    return total.sqrt()


def clip_gradients_(params: Iterable[nn.Parameter], *, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
    """Scale grads so the global norm is at most max_norm (0 disables); returns the norm before clipping."""
    params = list(params)
    norm = global_grad_norm(params, ctx=ctx)
    if max_norm > 0:
        # Megatron's clip_coeff = max_norm / (norm + 1e-6), applied only when < 1; clamp does that
        # on the device, without a host sync.
        coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coeff)
    return norm
