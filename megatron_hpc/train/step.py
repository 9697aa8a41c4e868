"""One optimizer step: micro-batches, forward, loss scaling, backward, DP all-reduce, clip, AdamW."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hpc.parallel.device import mark_step
from megatron_hpc.parallel.grads import BUCKET_MB, OverlappedGradReducer, all_reduce_gradients, clip_gradients_
from megatron_hpc.train.precision import DynamicGradScaler


@dataclass(frozen=True, slots=True)
class StepOutput:
    loss: torch.Tensor
    """Mean lm loss of this rank's micro-batches (0-dim, on device; not DP-averaged)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (0-dim, on device; same on all ranks)."""
    skipped: bool
    """The loss or gradients were not finite, so the optimizer step was not taken."""
    overflow: bool = False
    """Skipped by the fp16 loss scaler while it could still back off: routine, not divergence."""
    loss_scale: float = 1.0
    """Loss scale after this step's update (1.0 without a scaler), for the iteration line."""


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Sequence[torch.Tensor], *,
               ctx: ParallelContext, clip_grad: float, autocast_dtype: torch.dtype | None,
               device_type: str, scaler: DynamicGradScaler | None = None,
               grad_reducer: OverlappedGradReducer | None = None, grad_bucket_mb: float = BUCKET_MB) -> StepOutput:
    """One step over this rank's micro-batches, each (mbs, S + 1) token ids.

    With `grad_reducer` the DP all-reduce overlaps the last micro-batch's backward; without it the
    buckets (of grad_bucket_mb MiB) are all-reduced after backward.
    One host sync off XLA: whether the gradient norm is finite, to skip the optimizer step
    instead of writing NaN into the weights and Adam moments (Megatron's "skipped iterations").
    On XLA the check is left out: it would cut the graph, and a neuron_parallel_compile trial
    returns zeros anyway. With an fp16 `scaler` the same check is its overflow test.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    # Off XLA the first backward assigns the gradients (no zero fill, no add); on XLA zero in
    # place so that the graph keeps one shape (neuron-xla.md 3.3).
    optimizer.zero_grad(set_to_none=device_type != "xla")
    total = torch.zeros((), device=micro_batches[0].device)
    scale = scaler.scale if scaler is not None else 1.0
    cast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
            else contextlib.nullcontext())
    for m, tokens in enumerate(micro_batches):
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        with cast:
            logits = model(ids)  # (mbs, S, V/tp)
        loss = vocab_parallel_cross_entropy(logits, labels, group=ctx.tp_group).mean()
        del logits  # the loss saved what backward needs; do not hold the logits through backward
        if grad_reducer is not None and m == len(micro_batches) - 1:
            grad_reducer.arm()
        # Every micro-batch has mbs * S tokens, so averaging micro-batch means and then DP
        # replicas gives the token mean of the global batch.
        (loss * (scale / len(micro_batches))).backward()
        total += loss.detach()
    # XLA: run forward and backward as one graph, then the reduce, clip and update as the step's second (the
    # reference's cut after backward; it bounds what a graph holds). No-op elsewhere.
    mark_step(device_type)
    if grad_reducer is not None:
        grad_reducer.finish()
    else:
        all_reduce_gradients(params, group=ctx.dp_group, bucket_mb=grad_bucket_mb)
    if scale != 1.0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], 1.0 / scale)
    norm = clip_gradients_(params, max_norm=clip_grad, ctx=ctx)
    # The norm is the same on every rank (it was all-reduced), so all ranks skip together.
    skipped = device_type != "xla" and not bool(torch.isfinite(norm).item())
    overflow = False
    if scaler is not None:
        overflow = skipped and scale > scaler.min_scale
        scaler.update(found_inf=skipped)
    if not skipped:
        optimizer.step()
    return StepOutput(loss=total / len(micro_batches), grad_norm=norm, skipped=skipped, overflow=overflow,
                      loss_scale=scaler.scale if scaler is not None else 1.0)
