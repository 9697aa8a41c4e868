"""One optimizer step: micro-batches, forward, loss scaling, backward, DP all-reduce, clip, AdamW; and the count of
steps skipped because their gradients were not finite."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron_hpc.errors import TrainingError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hpc.parallel.device import DeviceInfo, mark_step, when_step_done
from megatron_hpc.parallel.grads import (
    BUCKET_MB,
    OverlappedGradReducer,
    all_reduce_gradients,
    all_reduce_sequence_parallel_grads,
    all_reduce_sum_,
    clip_gradients_,
)
from megatron_hpc.parallel.pipeline import PipelineRunner
from megatron_hpc.train.distributed_optimizer import DistributedOptimizer
from megatron_hpc.train.masked_step import step_where
from megatron_hpc.train.precision import DynamicGradScaler
from megatron_hpc.train.state import TrainState
from megatron_hpc.train.xla_zero import XlaZeroOptimizer


@dataclass(frozen=True, slots=True)
class StepOutput:
    loss: torch.Tensor
    """Mean lm loss of this rank's micro-batches (0-dim, on device; not DP-averaged)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (0-dim, on device; same on all ranks)."""
    finite: torch.Tensor
    """Whether the gradient norm was finite, i.e. the optimizer step was taken (0-dim bool, on device)."""
    skipped: bool | None
    """The loss or gradients were not finite, so the optimizer step was not taken; None on XLA, where the host
    learns it one step later (`finite` holds it on the device)."""
    overflow: bool = False
    """Skipped by the fp16 loss scaler while it could still back off: routine, not divergence."""
    loss_scale: float = 1.0
    """Loss scale after this step's update (1.0 without a scaler), for the iteration line."""


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | DistributedOptimizer | XlaZeroOptimizer,
               micro_batches: Sequence[torch.Tensor], *,
               ctx: ParallelContext, clip_grad: float, autocast_dtype: torch.dtype | None,
               device_type: str, scaler: DynamicGradScaler | None = None,
               grad_reducer: OverlappedGradReducer | None = None, grad_bucket_mb: float = BUCKET_MB,
               pipeline: PipelineRunner | None = None) -> StepOutput:
    """One step over this rank's micro-batches, each (mbs, S + 1) token ids.

    With `grad_reducer` the DP all-reduce overlaps the last micro-batch's backward; without it the
    buckets (of grad_bucket_mb MiB) are all-reduced after backward.
    One host sync off XLA: whether the gradient norm is finite, to skip the optimizer step
    instead of writing NaN into the weights and Adam moments (Megatron's "skipped iterations").
    With an fp16 `scaler` the same check is its overflow test. On XLA a host read would cut the
    graph and stall the device, so the flag stays on the device: the update always runs and a
    select keeps the old weights and Adam state when it is not finite (`step_where` (train/masked_step.py)), and
    SkipTracker reads the flag one step later.
    With a DistributedOptimizer (ZeRO-1) the gradients are reduce-scattered instead, and the norm, clip and update
    act on this DP rank's slice (train/distributed_optimizer.py); with parallel.overlap_param_gather its update
    leaves the all-gathers in flight for the next step's forward to wait for. With an XlaZeroOptimizer (the same on
    XLA) they act on this DP rank's fp32 master shards (train/xla_zero.py).
    With `pipeline` the micro-batches go through this rank's pipeline stages by its schedule (forward and
    backward interleaved across stages); the loss is then the last stage's, 0 on the others.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.before_forward()  # parallel.overlap_param_gather without forward hooks: the last step's gathers
    # Off XLA the first backward assigns the gradients (no zero fill, no add); on XLA zero in
    # place so that the graph keeps one shape (neuron-xla.md 3.3).
    optimizer.zero_grad(set_to_none=device_type != "xla")
    total = torch.zeros((), device=micro_batches[0].device)
    scale = scaler.scale if scaler is not None else 1.0
    cast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
            else contextlib.nullcontext())
    if pipeline is not None:
        total = pipeline.train_losses(micro_batches, scale=scale, autocast=cast)
    for m, tokens in enumerate(micro_batches if pipeline is None else ()):
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        with cast:
            logits = model(ids)  # (mbs, S, V/tp)
        loss = vocab_parallel_cross_entropy(logits, labels, group=ctx.tp_group).mean()
        del logits  # the loss saved what backward needs; do not hold the logits through backward
        if m == len(micro_batches) - 1:
            if grad_reducer is not None:
                grad_reducer.arm()
            elif isinstance(optimizer, DistributedOptimizer):
                optimizer.arm()  # its overlapped reduce-scatter, when it has one
        # Every micro-batch has mbs * S tokens, so averaging micro-batch means and then DP
        # replicas gives the token mean of the global batch.
        (loss * (scale / len(micro_batches))).backward()
        total += loss.detach()
    # XLA: run forward and backward as one graph, then the reduce, clip and update as the step's second (the
    # reference's cut after backward; it bounds what a graph holds). No-op elsewhere.
    mark_step(device_type)
    if isinstance(optimizer, DistributedOptimizer):
        # The DP reduce-scatter into this rank's slices (started in backward when overlapped), then the TP sum of
        # the sequence-parallel grads on their pieces there (sums commute); the norm, the clip and the update then
        # touch the slices alone.
        optimizer.reduce_gradients()
        all_reduce_sum_(optimizer.sequence_parallel_grads(), group=ctx.tp_group)
        norm = optimizer.clip_grad_norm_(max_norm=clip_grad, ctx=ctx, unscale=1.0 / scale)
    elif isinstance(optimizer, XlaZeroOptimizer):
        # The TP sum of the sequence-parallel grads on the whole bf16 gradients, then the DP reduce-scatter into the
        # fp32 shards, where the norm, the clip and the update act (sums commute, as above).
        all_reduce_sequence_parallel_grads(params, group=ctx.tp_group)
        optimizer.reduce_gradients()
        norm = optimizer.clip_grad_norm_(max_norm=clip_grad, ctx=ctx, unscale=1.0 / scale)
    else:
        if grad_reducer is not None:
            grad_reducer.finish()
        else:
            all_reduce_gradients(params, group=ctx.dp_group, bucket_mb=grad_bucket_mb)
        # Sequence parallelism: replicated params' grads are partial per TP rank (no-op without tagged params).
        # After the DP reduce, whose overlapped buckets copy back into .grad, and after the pipeline schedule too,
        # which ran inside train_losses above.
        all_reduce_sequence_parallel_grads(params, group=ctx.tp_group)
        if scale != 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], 1.0 / scale)
        norm = clip_gradients_(params, max_norm=clip_grad, ctx=ctx)
    # The norm is the same on every rank (it was all-reduced), so all ranks skip together.
    finite = torch.isfinite(norm)
    if device_type == "xla":
        if isinstance(optimizer, XlaZeroOptimizer):
            optimizer.step_where(finite)
        else:
            step_where(optimizer, finite)
        return StepOutput(loss=total / len(micro_batches), grad_norm=norm, finite=finite, skipped=None)
    skipped = not bool(finite.item())  # host sync: the skip decision
    overflow = False
    if scaler is not None:
        overflow = skipped and scale > scaler.min_scale
        scaler.update(found_inf=skipped)
    if not skipped:
        optimizer.step()
    return StepOutput(loss=total / len(micro_batches), grad_norm=norm, finite=finite, skipped=skipped,
                      overflow=overflow, loss_scale=scaler.scale if scaler is not None else 1.0)


def _unstep(optimizer: torch.optim.Optimizer) -> None:
    """Take back AdamW's step count of a step that `step_where` (train/masked_step.py) did not apply."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] -= 1


class SkipTracker:
    """Steps skipped because their gradients were not finite: the streak that ends the run at
    train.max_skipped_steps (Megatron's divergence stop) and the count of applied steps, which drives the LR.

    Off XLA each step's flag is known at once (train_step read it). On XLA it stays on the device; each step's
    closure reads the previous step's flag, which the previous graph already computed, so the host never waits
    for the step in flight. The counts and the stop therefore act one step late there: the step right after a
    skipped one runs with the LR and Adam's bias correction one step ahead, and the run stops one step after the
    streak reached the limit, with the same message. `settle()` reads the pending flag at once (a host sync),
    for saves and the run's end.
    """

    def __init__(self, device: DeviceInfo, optimizer: torch.optim.Optimizer, *, state: TrainState, limit: int,
                 phase: str):
        self.device, self.optimizer, self.limit, self.phase = device, optimizer, limit, phase
        self.state = state
        """Its lr_steps is the count of applied (not skipped) optimizer steps; on XLA the step in flight counts as
        applied until its flag is read."""
        self.streak = 0
        self._pending: list[tuple[int, float, torch.Tensor]] = []

    def add(self, result: StepOutput, *, iteration: int, lr: float) -> None:
        """Count the step that ended at `iteration`; TrainingError once the streak reaches the limit."""
        if result.skipped is not None:
            self.state.lr_steps += 0 if result.skipped else 1
            # fp16 overflow skips are routine (the loss scale backs off); only real divergence counts.
            self._count(result.skipped and not result.overflow, iteration=iteration, lr=lr)
            return
        self.state.lr_steps += 1
        if self._pending:  # the previous step's flag: read after this step's sync, when its graph is done
            when_step_done(self.device, self._resolve, self._pending[-1][0])
        self._pending.append((iteration, lr, result.finite))

    def settle(self) -> None:
        """Read every pending flag now (XLA: a host sync; nothing to do elsewhere)."""
        if self._pending:
            self._resolve(self._pending[-1][0])

    def _resolve(self, upto: int) -> None:
        while self._pending and self._pending[0][0] <= upto:
            iteration, lr, finite = self._pending.pop(0)
            skipped = not bool(finite.item())  # host read of a value the device already computed
            if skipped:
                self.state.lr_steps -= 1
                _unstep(self.optimizer)
            self._count(skipped, iteration=iteration, lr=lr)

    def _count(self, skipped: bool, *, iteration: int, lr: float) -> None:
        self.streak = self.streak + 1 if skipped else 0
        if self.streak >= self.limit:
            raise TrainingError(
                f"{self.phase} phase: the loss or gradients were not finite for {self.streak} steps in a row "
                f"(iterations {iteration + 1 - self.streak}-{iteration}, lr {lr:.3g}); lower optim.lr, keep "
                f"optim.clip_grad above 0, or check the data (train.max_skipped_steps sets the limit)")
