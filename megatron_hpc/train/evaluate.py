"""Validation: every train.eval_interval steps and at the last step, eval_iters global batches without grad.

As Megatron's evaluate(): each eval iteration runs one global batch (this rank's micro-batches), the
loss is the mean over micro-batches, eval iterations and DP replicas, and the last rank prints the
block of evaluate_and_print_results (shared/reference/megatron-and-launchers.md 4.1). The final
evaluation is skipped when the last step already was an interval step, and its prefix is
"iteration N" like the others.

Samples: evaluation k (k = (iteration - 1) // eval_interval, so a resumed run reads what an
uninterrupted one would) reads valid global batches [k * eval_iters, (k + 1) * eval_iters), split
over micro-batches and DP ranks as training splits its batches. Indexed data reads the valid split,
built for Megatron's count (train_iters // eval_interval + 1) * eval_iters * global_batch_size
(get_train_valid_test_num_samples), so its index cache matches a Megatron run's. Synthetic data reads
sample ids offset by VALID_SAMPLE_OFFSET, a range training never reaches.

Test: after the last step of the run phase, eval_iters global batches from the start of the test split,
built for Megatron's count eval_iters * global_batch_size (Megatron's do_test), printed as "validation loss at
iteration N on test set". On when train.eval_test and eval_iters are set and data.split gives the test split
weight; synthetic data has no test split.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatron_hpc.config.schema import DataConfig, TrainConfig
from megatron_hpc.data.blending import BlendedDataset, build_split_dataset
from megatron_hpc.data.gpt_dataset import GPTDataset, GPTIndexConfig, split_matrix
from megatron_hpc.data.synthetic import SyntheticTokens
from megatron_hpc.errors import DataError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hpc.parallel.device import DeviceInfo, step_barrier
from megatron_hpc.parallel.pipeline import PipelineRunner, to_all_stages
from megatron_hpc.plan.batch import BatchLayout, num_test_samples, num_valid_samples
from megatron_hpc.plan.planner import Plan
from megatron_hpc.train.metrics import MetricsLogger

VALID_SAMPLE_OFFSET = 10**12
"""Synthetic validation sample ids start here; training would need 10^12 samples to reach them."""


class _Batches(Protocol):
    def batch(self, indices: Sequence[int]) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class OffsetSynthetic:
    tokens: SyntheticTokens

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        return self.tokens.batch([VALID_SAMPLE_OFFSET + i for i in indices])


@dataclass(frozen=True, slots=True)
class _SplitSamples:
    dataset: GPTDataset | BlendedDataset

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.dataset.text(i) for i in indices]))


@dataclass(kw_only=True)
class Evaluator:
    data: _Batches | None
    """Valid batches, or None when validation is off."""
    interval: int
    eval_iters: int
    train_iters: int
    """Steps of this phase: the last one is always evaluated."""
    layout: BatchLayout
    """The plan's split of a global batch over micro-batches and DP ranks."""
    ctx: ParallelContext
    device: DeviceInfo
    autocast_dtype: torch.dtype | None
    metrics: MetricsLogger
    pipeline: PipelineRunner | None = None
    """This rank's pipeline stages and schedule (forward only here); None runs the whole model."""
    test_data: _Batches | None = None
    """Test batches, or None when the test split is not evaluated."""

    def should_evaluate(self, iteration: int) -> bool:
        if self.data is None:
            return False
        return iteration % self.interval == 0 or iteration == self.train_iters

    def maybe_evaluate(self, iteration: int, model: nn.Module) -> float | None:
        """Evaluate after step `iteration` when it is due; returns the DP-averaged loss (all ranks)."""
        if not self.should_evaluate(iteration):
            return None
        began = time.perf_counter()
        loss = self.evaluate(model, index=(iteration - 1) // self.interval)
        self.metrics.log_validation(iteration, lm_loss=loss)
        self.metrics.exclude_time(time.perf_counter() - began)
        return loss

    def evaluate_test(self, iteration: int, model: nn.Module) -> float | None:
        """After the last step: the test split's loss (all ranks), logged; None when it is not evaluated."""
        if self.test_data is None:
            return None
        began = time.perf_counter()
        loss = self._mean_loss(model, self.test_data, first_batch=0)
        self.metrics.log_validation(iteration, lm_loss=loss, split="test")
        self.metrics.exclude_time(time.perf_counter() - began)
        return loss

    def evaluate(self, model: nn.Module, *, index: int) -> float:
        """Mean lm loss of evaluation `index`, averaged over eval_iters, micro-batches and DP."""
        assert self.data is not None, "evaluate() needs validation data"
        return self._mean_loss(model, self.data, first_batch=index * self.eval_iters)

    def _mean_loss(self, model: nn.Module, data: _Batches, *, first_batch: int) -> float:
        """Mean lm loss of global batches [first_batch, first_batch + eval_iters) of `data`."""
        ctx, dev = self.ctx, self.device.device
        num_micro = self.layout.num_micro_batches
        was_training = model.training
        model.eval()
        total = torch.zeros((), device=dev, dtype=torch.float32)
        cast = (torch.autocast(self.device.kind, dtype=self.autocast_dtype) if self.autocast_dtype is not None
                else contextlib.nullcontext())
        with torch.no_grad():
            for j in range(self.eval_iters):
                micro = [data.batch(ids).to(dev)
                         for ids in self.layout.rank_indices(first_batch + j, dp_rank=ctx.dp_rank)]
                if self.pipeline is not None:  # the last stage's losses; the others add 0
                    total += self.pipeline.eval_losses(micro, autocast=cast)
                for tokens in micro if self.pipeline is None else ():
                    with cast:
                        logits = model(tokens[:, :-1])  # (mbs, S, V/tp)
                    total += vocab_parallel_cross_entropy(logits, tokens[:, 1:], group=ctx.tp_group).mean().float()
                step_barrier(self.device)  # XLA: one graph per eval batch
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.dp_group)
        to_all_stages(total, ctx)
        model.train(was_training)
        # Host sync, once per evaluation: the loss is printed.
        return total.item() / (ctx.dp_size * num_micro * self.eval_iters)


def _valid_data(tcfg: TrainConfig, data: DataConfig, *, vocab_size: int, plan: Plan) -> _Batches | None:
    if plan.data_source == "synthetic":
        return OffsetSynthetic(SyntheticTokens(vocab_size=vocab_size, seq_length=plan.seq_length, seed=tcfg.seed))
    if not data.path:
        raise DataError("data.source is indexed but data.path is not set; validation needs its valid split")
    if split_matrix(data.split)[1] is None:
        warnings.warn(f"train.eval_interval is {tcfg.eval_interval} but data.split {data.split!r} gives the "
                      f"valid split no weight; validation is off (give the second weight a positive value)",
                      stacklevel=3)
        return None
    count = num_valid_samples(train_iters=tcfg.num_steps, eval_interval=tcfg.eval_interval,
                              eval_iters=tcfg.eval_iters, global_batch_size=plan.global_batch_size)
    config = GPTIndexConfig(seed=tcfg.seed, seq_length=plan.seq_length, split=data.split, cache_path=data.cache_path)
    dataset = build_split_dataset(data.path, split_name="valid", num_samples=count, config=config)
    if len(dataset) < count:
        raise DataError(f"the valid split of {data.path} gives {len(dataset)} samples, {count} are needed; "
                        f"this is a bug in the index build")
    return _SplitSamples(dataset)


def _test_data(tcfg: TrainConfig, data: DataConfig, *, plan: Plan, rank: int) -> _Batches | None:
    if not (tcfg.eval_test and tcfg.eval_iters > 0) or plan.data_source == "synthetic" or not data.path:
        return None
    if split_matrix(data.split)[2] is None:
        return None  # no test split, as Megatron's do_test is off without one
    count = num_test_samples(eval_iters=tcfg.eval_iters, global_batch_size=plan.global_batch_size)
    config = GPTIndexConfig(seed=tcfg.seed, seq_length=plan.seq_length, split=data.split, cache_path=data.cache_path)
    try:
        dataset = build_split_dataset(data.path, split_name="test", num_samples=count, config=config)
    except DataError as exc:  # a small corpus's test split may hold no sample; training goes on without it
        if rank == 0:  # one line for the run, as the trainer's other warnings
            print(f"megatron-hpc: warning: the test split is not evaluated at the end: {exc}; or set "
                  "train.eval_test=false", file=sys.stderr, flush=True)
        return None
    return _SplitSamples(dataset)


def build_evaluator(tcfg: TrainConfig, data: DataConfig, *, vocab_size: int, plan: Plan, ctx: ParallelContext,
                    device: DeviceInfo, autocast_dtype: torch.dtype | None, train_iters: int,
                    metrics: MetricsLogger, pipeline: PipelineRunner | None = None) -> Evaluator:
    """The evaluator of this phase; it does nothing when train.eval_interval or eval_iters is 0 (and, for the
    test split, when train.eval_test is off or data.split gives it no weight)."""
    enabled = tcfg.eval_interval > 0 and tcfg.eval_iters > 0
    return Evaluator(data=_valid_data(tcfg, data, vocab_size=vocab_size, plan=plan) if enabled else None,
                     interval=max(1, tcfg.eval_interval), eval_iters=tcfg.eval_iters, train_iters=train_iters,
                     layout=plan.batch, ctx=ctx, device=device, autocast_dtype=autocast_dtype, metrics=metrics,
                     pipeline=pipeline, test_data=_test_data(tcfg, data, plan=plan, rank=ctx.rank))
