"""A checkpoint's pipeline stages scoring evaluation inputs, forward only, as the trainer runs them: each pipeline
rank holds its stages and torch.distributed.pipelining's schedule passes the activations from stage to stage
(ScheduleGPipe, or ScheduleLoopedBFS for several virtual stages per rank, as parallel/pipeline.py chooses for
`afab`). The last stage reduces its logits to one value per position (a loss, an argmax id) and broadcasts them over
the pipeline group, so every rank gets the figures a whole model would give.

The schedule's stages learn their activation shapes from the first call and keep them, so every call has one
shape: the rows padded at the end to seq_length columns and the batch to batch_size rows. The model is causal, so
the padding never changes the logits of a real position, and the reduced values are cut back to the real ones.

Shape legend: B rows, W columns (at most seq_length), V/tp this rank's vocabulary shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.context import ParallelContext

PAD_ID = 0
"""Any valid id: padded columns come after every real one and padded rows are dropped."""


class PipelinedScorer:
    """This rank's stages of a GPT run forward on fixed (batch_size, seq_length) inputs."""

    def __init__(self, model: GPT, ctx: ParallelContext, *, batch_size: int, seq_length: int):
        # Imported here: torch.distributed.pipelining imports dynamo and DTensor (about a second of CPU), which
        # `generate`, `serve` and a whole-model `evaluate` would otherwise pay for a class they never build.
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS

        self.model, self.ctx = model, ctx
        self.group = model.group  # the TP group, as GPT.group: the vocab-parallel reductions run over it
        self.shape = (batch_size, seq_length)
        device = next(model.parameters()).device
        num_stages = ctx.pp_size * len(model.stages)
        stages = [PipelineStage(chunk, layout.index, num_stages, device, group=ctx.pp_group)
                  for chunk, layout in zip(model.chunks(), model.stages)]
        self.schedule = (ScheduleLoopedBFS(stages, n_microbatches=1) if len(stages) > 1
                         else ScheduleGPipe(stages[0], n_microbatches=1))
        self.last_rank = dist.get_global_rank(ctx.pp_group, ctx.pp_size - 1)

    def apply(self, inputs: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor], *,
              dtype: torch.dtype) -> torch.Tensor:
        """reduce(logits (B, W, V/tp)) -> (B, W) of `dtype` for the input ids (B, W), on every rank. Every rank of
        the world calls it with the same inputs."""
        b, w = inputs.shape
        if b > self.shape[0] or w > self.shape[1]:
            raise ValueError(f"inputs {tuple(inputs.shape)} exceed the scorer's fixed shape {self.shape}")
        padded = torch.full(self.shape, PAD_ID, dtype=torch.long)
        padded[:b, :w] = inputs
        with torch.no_grad():
            logits = self.schedule.eval(*((padded,) if self.model.has_first else ()))
        out = torch.zeros((b, w), dtype=dtype)
        if self.model.has_last:
            out = reduce(logits[:b, :w]).to(dtype).contiguous()
        dist.broadcast(out, src=self.last_rank, group=self.ctx.pp_group)
        return out
