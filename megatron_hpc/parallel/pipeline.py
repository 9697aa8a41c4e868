"""Pipeline parallelism: this rank's stages run by torch.distributed.pipelining's schedules.

torch maintains the stages' send/recv and the schedules: Schedule1F1B (PipeDream-flush), ScheduleInterleaved1F1B
(Megatron's interleaved 1F1B over virtual stages, virtual stage s on pipeline rank s % p), ScheduleGPipe (all
forward, then all backward; for debugging) and ScheduleLoopedBFS, its form for several stages per rank. They compose
with our tensor-parallel layers because every TP rank of a stage runs the same schedule, so the TP collectives inside
a stage's forward and backward are issued in the same order on all of them; the stages talk over this rank's
pipeline group, a gloo or NCCL group like any other.

What we add around the schedule: the loss (vocab-parallel cross entropy, pre-divided by the micro-batch count so
that the gradients sum exactly as the one-process step's do: scale_grads is off), the all-reduce of the tied
embeddings' gradient between the first and last stage (Megatron's embedding group), and the loss of the last
stage handed to every stage for logging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hpc.plan.stages import StageLayout

SCHEDULES = ("1f1b", "afab")


class StagedModel(Protocol):
    """What the runner needs of a model that holds this rank's pipeline stages (model/gpt.py's GPT is one).

    A protocol, not the GPT class, so that parallel/ stays below model/ (dependencies point down).
    """

    @property
    def stages(self) -> Sequence[StageLayout]:
        """This rank's virtual stages, in the order of chunks()."""
        ...

    @property
    def has_first(self) -> bool:
        """Whether one of the stages is the first (it takes the token ids)."""
        ...

    @property
    def has_last(self) -> bool:
        """Whether one of the stages is the last (it returns the logits the loss reads)."""
        ...

    def chunks(self) -> list[nn.Module]:
        """One module per stage; each is run by its own PipelineStage."""
        ...

    def shared_embedding(self) -> nn.Parameter | None:
        """The tied word embeddings this rank shares with the other end of the pipeline, or None."""
        ...


class _Loss:
    """loss_fn of the schedule: the micro-batch's mean token loss, times loss scale / micro-batches."""

    def __init__(self, ctx: ParallelContext, num_micro_batches: int):
        self.group = ctx.tp_group
        self.factor = 1.0 / num_micro_batches
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = vocab_parallel_cross_entropy(logits, labels, group=self.group).mean()
        return loss * (self.scale * self.factor)


class PipelineRunner:
    """Runs one step's micro-batches through this rank's stages with the configured schedule."""

    def __init__(self, model: StagedModel, ctx: ParallelContext, *, num_micro_batches: int, schedule: str,
                 device: torch.device, compile_chunks: bool = False, compile_backend: str = "inductor"):
        # Imported here, not at the top: torch.distributed.pipelining imports dynamo and DTensor (about a second
        # of CPU), which every trainer process would pay at start-up, pipeline or not.
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        if schedule not in SCHEDULES:
            raise ValueError(f"parallel.pipeline_schedule={schedule!r}: use one of {SCHEDULES}")
        self.model, self.ctx, self.num_micro = model, ctx, num_micro_batches
        self.first, self.last = model.has_first, model.has_last
        self.loss = _Loss(ctx, num_micro_batches)
        num_stages = ctx.pp_size * len(model.stages)
        chunks = model.chunks()
        if compile_chunks:  # train.compile: each stage's forward is one torch.compile graph (its own backward)
            chunks = [torch.compile(chunk, backend=compile_backend) for chunk in chunks]
        stages = [PipelineStage(chunk, layout.index, num_stages, device, group=ctx.pp_group)
                  for chunk, layout in zip(chunks, model.stages)]
        common: dict[str, Any] = {"n_microbatches": num_micro_batches, "loss_fn": self.loss, "scale_grads": False}
        if len(stages) > 1:
            multi = ScheduleLoopedBFS if schedule == "afab" else ScheduleInterleaved1F1B
            self.schedule = multi(stages, **common)
        elif schedule == "afab":
            self.schedule = ScheduleGPipe(stages[0], **common)
        else:
            self.schedule = Schedule1F1B(stages[0], **common)
        self.shared = model.shared_embedding()

    def _run(self, micro_batches: Sequence[torch.Tensor], *, train: bool) -> torch.Tensor:
        # The schedule splits the whole batch along dim 0 into equal micro-batches: our micro-batches, in order.
        tokens = torch.cat(list(micro_batches))
        args = (tokens[:, :-1],) if self.first else ()
        target = tokens[:, 1:] if self.last else None
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=losses if self.last else None, return_outputs=False)
        total = torch.zeros((), device=tokens.device, dtype=torch.float32)
        for loss in losses:
            total += loss.detach().float()
        return total

    def train_losses(self, micro_batches: Sequence[torch.Tensor], *, scale: float,
                     autocast: contextlib.AbstractContextManager) -> torch.Tensor:
        """Forward and backward of every micro-batch; this rank's gradients accumulated (times `scale`) and the
        tied embeddings' gradient summed over the embedding group. Returns the sum of the micro-batch losses
        (unscaled) on the last stage, 0 elsewhere."""
        self.loss.scale = scale
        with autocast:
            total = self._run(micro_batches, train=True)
        self.sync_embedding_grads()
        return total * (self.num_micro / scale)

    def eval_losses(self, micro_batches: Sequence[torch.Tensor], *,
                    autocast: contextlib.AbstractContextManager) -> torch.Tensor:
        """Sum of the micro-batch losses, forward only; on the last stage, 0 elsewhere."""
        self.loss.scale = 1.0
        with torch.no_grad(), autocast:
            return self._run(micro_batches, train=False) * self.num_micro

    def sync_embedding_grads(self) -> None:
        """Megatron's _allreduce_word_embedding_grads: the first and last stage's copies of the tied word
        embeddings get the sum of both gradients, so the same update keeps them equal."""
        if self.shared is None or self.ctx.embedding_group is None:
            return
        grad = self.shared.grad
        if grad is None:  # a stage whose micro-batches never reached the table: contribute zeros
            grad = self.shared.grad = torch.zeros_like(self.shared)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.ctx.embedding_group)


def to_all_stages(value: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The last stage's value on every stage (the others pass zeros); a sum over the pipeline group."""
    if ctx.pp_size > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=ctx.pp_group)
    return value
