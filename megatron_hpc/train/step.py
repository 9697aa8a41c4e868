"""One optimizer step (torchtitan's train_step): zero, forward and backward of each micro-batch, reduce and clip,
the finite check, the update; and the count of steps skipped because their gradients were not finite.

How the micro-batches run (MicroBatches: one after another through the model; PipelineSchedule: a pipeline rank's
schedule) is chosen once at build time (train/loop.py), and what differs between the optimizers sits behind
train/optimizer.py's verbs, so train_step has no type or device branch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from megatron_hpc.errors import TrainingError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hpc.parallel.device import DeviceInfo, mark_step, when_step_done
from megatron_hpc.parallel.pipeline import PipelineRunner
from megatron_hpc.train.optimizer import TrainOptimizer
from megatron_hpc.train.precision import DynamicGradScaler
from megatron_hpc.train.state import TrainState


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


class ForwardBackward(Protocol):
    def __call__(self, micro_batches: Sequence[torch.Tensor], *, scale: float,
                 before_last_backward: Callable[[], None]) -> torch.Tensor:
        """Forward and backward of every micro-batch (each (mbs, S + 1) token ids), the loss times `scale` over
        the number of micro-batches; the sum of the micro-batch losses (0-dim, on device; 0 on a pipeline rank
        without the last stage). The step's graph is cut after the last backward (XLA)."""


def train_step(forward_backward: ForwardBackward, optimizer: TrainOptimizer, micro_batches: Sequence[torch.Tensor],
               *, scaler: DynamicGradScaler | None = None) -> StepOutput:
    """One step over this rank's micro-batches.

    The loss is averaged over the micro-batches (each has mbs * S tokens, so averaging micro-batch means and then
    DP replicas gives the token mean of the global batch) and multiplied by the fp16 `scaler`'s scale, which the
    reduce divides out again. A step whose gradient norm is not finite leaves the weights and Adam's moments as
    they were instead of writing NaN into them (Megatron's "skipped iterations"): off XLA one host sync decides
    it, the fp16 scaler's overflow test too; on XLA the flag stays on the device (`step_if_finite`).
    """
    scale = scaler.scale if scaler is not None else 1.0
    optimizer.before_forward()
    optimizer.zero_grad()
    total = forward_backward(micro_batches, scale=scale, before_last_backward=optimizer.mark_last_backward)
    norm = optimizer.reduce_and_clip(loss_scale=scale)
    # The norm is the same on every rank (it was all-reduced), so all ranks skip together.
    finite = torch.isfinite(norm)
    skipped = optimizer.step_if_finite(finite)
    overflow, loss_scale = _update_loss_scale(scaler, skipped=skipped)
    return StepOutput(loss=total / len(micro_batches), grad_norm=norm, finite=finite, skipped=skipped,
                      overflow=overflow, loss_scale=loss_scale)


def _update_loss_scale(scaler: DynamicGradScaler | None, *, skipped: bool | None) -> tuple[bool, float]:
    """fp16 (never on XLA, so `skipped` is known): back the scale off after a skipped step, grow it after a run of
    finite ones. Whether the skip was the scaler's overflow, and the scale after the update."""
    if scaler is None:
        return False, 1.0
    overflow = bool(skipped) and scaler.scale > scaler.min_scale
    scaler.update(found_inf=bool(skipped))
    return overflow, scaler.scale


class MicroBatches:
    """Forward and backward of each micro-batch in turn through this rank's whole model (no pipeline)."""

    def __init__(self, model: nn.Module, *, ctx: ParallelContext, autocast_dtype: torch.dtype | None,
                 device_type: str):
        self.model, self.ctx, self.autocast_dtype, self.device_type = model, ctx, autocast_dtype, device_type

    def __call__(self, micro_batches: Sequence[torch.Tensor], *, scale: float,
                 before_last_backward: Callable[[], None]) -> torch.Tensor:
        total = torch.zeros((), device=micro_batches[0].device)
        cast = _autocast(self.device_type, self.autocast_dtype)
        for m, tokens in enumerate(micro_batches):
            ids, labels = tokens[:, :-1], tokens[:, 1:]
            with cast:
                logits = self.model(ids)  # (mbs, S, V/tp)
            loss = vocab_parallel_cross_entropy(logits, labels, group=self.ctx.tp_group).mean()
            del logits  # the loss saved what backward needs; do not hold the logits through backward
            if m == len(micro_batches) - 1:
                before_last_backward()
            (loss * (scale / len(micro_batches))).backward()
            total += loss.detach()
        # XLA: run forward and backward as one graph, then the reduce, clip and update as the step's second (the
        # reference's cut after backward; it bounds what a graph holds). No-op elsewhere.
        mark_step(self.device_type)
        return total


class PipelineSchedule:
    """This pipeline rank's stages through the runner's schedule, forward and backward interleaved across stages;
    the loss is the last stage's, 0 on the others. The schedule runs the last backward itself, so nothing is armed
    before it (build_optimizer overlaps no reduce under pipelining)."""

    def __init__(self, runner: PipelineRunner, *, autocast_dtype: torch.dtype | None, device_type: str):
        self.runner, self.autocast_dtype, self.device_type = runner, autocast_dtype, device_type

    def __call__(self, micro_batches: Sequence[torch.Tensor], *, scale: float,
                 before_last_backward: Callable[[], None]) -> torch.Tensor:
        total = self.runner.train_losses(micro_batches, scale=scale,
                                         autocast=_autocast(self.device_type, self.autocast_dtype))
        mark_step(self.device_type)  # as MicroBatches (pipelines do not run on XLA yet: a no-op)
        return total


def _autocast(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


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

    def __init__(self, device: DeviceInfo, optimizer: TrainOptimizer, *, state: TrainState, limit: int,
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
                self.optimizer.take_back_step()
            self._count(skipped, iteration=iteration, lr=lr)

    def _count(self, skipped: bool, *, iteration: int, lr: float) -> None:
        self.streak = self.streak + 1 if skipped else 0
        if self.streak >= self.limit:
            raise TrainingError(
                f"{self.phase} phase: the loss or gradients were not finite for {self.streak} steps in a row "
                f"(iterations {iteration + 1 - self.streak}-{iteration}, lr {lr:.3g}); lower optim.lr, keep "
                f"optim.clip_grad above 0, or check the data (train.max_skipped_steps sets the limit)")
