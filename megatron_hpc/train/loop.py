"""train(cfg, ctx): build the model, optimizer and data, then step, log, repeat (nanoGPT's train.py)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

import torch
import torch.distributed as dist

from megatron_hpc.checkpoint.checkpointer import Checkpointer
from megatron_hpc.config.schema import RunConfig, TrainConfig
from megatron_hpc.data.loader import IndexedBatches, build_indexed_batches, check_vocabulary
from megatron_hpc.data.synthetic import SyntheticTokens, micro_batch_indices
from megatron_hpc.errors import DataError
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceFeed, DeviceInfo, seed_everything, step_barrier, when_step_done
from megatron_hpc.parallel.grads import build_grad_reducer
from megatron_hpc.plan.vocab import padded_vocab_size
from megatron_hpc.train.evaluate import build_evaluator
from megatron_hpc.train.init_skip import skip_random_init
from megatron_hpc.train.lr import lr_at
from megatron_hpc.train.metrics import IterationRecord, MetricsLogger
from megatron_hpc.train.optim import build_optimizer, set_lr
from megatron_hpc.train.precision import autocast_dtype_for, build_loss_scaler, compute_label
from megatron_hpc.train.step import SkipTracker, StepOutput, train_step
from megatron_hpc.train.stop import StopDecision, StopWatch, record_stop
from megatron_hpc.train.tensorboard import open_tensorboard

Phase = Literal["compile", "run"]


@dataclass(frozen=True, slots=True)
class TrainSummary:
    steps: int
    """Optimizer steps taken."""
    consumed_samples: int
    """Samples consumed across all DP ranks."""
    records: list[IterationRecord]
    """Every logged interval, on every rank (only the last rank prints them)."""
    stopped: StopDecision | None = None
    """Set when a signal or the time budget ended the run early (after a save)."""


def model_padded_vocab(cfg: RunConfig, ctx: ParallelContext) -> int:
    return padded_vocab_size(cfg.model.vocab_size, divisible_by=cfg.model.make_vocab_size_divisible_by,
                             tensor_parallel=ctx.tp_size)


def build_model(cfg: RunConfig, ctx: ParallelContext, *, device: torch.device,
                from_checkpoint: bool = False) -> tuple[GPT, int]:
    """The GPT for this rank, on `device`, and the padded vocabulary it was built with.

    With from_checkpoint, the weights are left uninitialised: the caller loads them next.
    """
    padded = model_padded_vocab(cfg, ctx)
    # Built on the CPU (TP-invariant init) and then moved, like Megatron's --use-cpu-initialization.
    with skip_random_init(from_checkpoint):
        model = GPT(cfg.model, ctx=ctx, padded_vocab=padded, seed=cfg.train.seed)
    return model.to(device), padded


def _build_data(cfg: RunConfig, ctx: ParallelContext) -> SyntheticTokens | IndexedBatches:
    """The token source; both give `.batch(indices)` -> (len, seq_length + 1) int64."""
    tcfg = cfg.train
    if cfg.data.source == "synthetic":
        return SyntheticTokens(vocab_size=cfg.model.vocab_size, seq_length=cfg.model.seq_length, seed=tcfg.seed)
    if cfg.data.source != "indexed":
        raise DataError(f"data.source {cfg.data.source!r} is not supported by the trainer; use synthetic or indexed")
    if cfg.data.path and ctx.is_first_rank:
        # One full read of every .bin is enough: rank 0's DataError ends the whole torchrun job.
        check_vocabulary(cfg.data.path, vocab_size=cfg.model.vocab_size)
    # Always the run phase's sample count, so a compile trial builds the run's index cache.
    return build_indexed_batches(cfg.data, seq_length=cfg.model.seq_length, seed=tcfg.seed, num_steps=tcfg.num_steps,
                                 global_batch_size=tcfg.global_batch_size, micro_batch_size=tcfg.micro_batch_size,
                                 dp_rank=ctx.dp_rank, dp_size=ctx.dp_size)


def train(cfg: RunConfig, ctx: ParallelContext, *, device: DeviceInfo, phase: Phase = "run",
          run_dir: Path | None = None, out: TextIO | None = None) -> TrainSummary:
    """Train for train.num_steps (phase run) or compile.num_steps (phase compile) steps."""
    out = sys.stdout if out is None else out  # looked up per call, so redirection and capture work
    tcfg = cfg.train
    num_steps = tcfg.num_steps if phase == "run" else cfg.compile.num_steps
    data = _build_data(cfg, ctx)  # before the model: data errors surface first
    autocast_dtype = autocast_dtype_for(tcfg.precision, device_kind=device.kind, float_dtype=device.float_dtype)
    scaler = build_loss_scaler(tcfg.precision)  # fp16 only
    seed_everything(device, tcfg.seed + ctx.dp_rank)  # dropout masks: same across TP, different across DP

    ckpt = Checkpointer(cfg, ctx, device=device, phase=phase, run_dir=run_dir,
                        padded_vocab=model_padded_vocab(cfg, ctx), out=out, scaler=scaler)
    resuming = ckpt.has_checkpoint()  # then the random init would be thrown away: skip it
    model, padded = build_model(cfg, ctx, device=device.device, from_checkpoint=resuming)
    if ctx.is_first_rank:
        print(_banner(cfg, ctx, model=model, padded=padded, device=device, phase=phase, num_steps=num_steps,
                      autocast_dtype=autocast_dtype), file=out, flush=True)
    step_model = torch.compile(model) if tcfg.compile and device.kind != "xla" else model
    optimizer = build_optimizer(model, optim=cfg.optim)
    start = ckpt.restore(model, optimizer)  # 0 without a checkpoint
    metrics = MetricsLogger(model=cfg.model, padded_vocab=padded, world_size=ctx.world_size,
                            train_iters=num_steps, global_batch_size=tcfg.global_batch_size, phase=phase,
                            log_interval=tcfg.log_interval, enabled=ctx.is_last_rank, run_dir=run_dir, out=out)
    metrics.tensorboard = open_tensorboard(run_dir, enabled=ctx.is_last_rank and tcfg.tensorboard,
                                           platform=cfg.launch.platform, device=device.device)
    evaluator = build_evaluator(cfg, ctx, device=device, autocast_dtype=autocast_dtype, train_iters=num_steps,
                                metrics=metrics)
    records: list[IterationRecord] = []
    interval = _IntervalSums(device=device.device)
    stopped: StopDecision | None = None
    # DP all-reduce started inside the last micro-batch's backward (None: after it; see parallel/grads.py).
    grad_reducer = build_grad_reducer(model.parameters(), group=ctx.dp_group, device_kind=device.kind,
                                      overlap=cfg.parallel.overlap_grad_reduce, bucket_mb=cfg.parallel.grad_bucket_mb)
    # Successful (not skipped) optimizer steps: the LR schedule advances only on those, as Megatron's
    # scheduler does; the checkpoint carries the count (lr_scheduler.successful_steps).
    skips = SkipTracker(device, optimizer, applied=ckpt.lr_steps if ckpt.lr_steps is not None else start,
                        limit=tcfg.max_skipped_steps, phase=phase)

    feed = DeviceFeed((_host_batches(data, step, cfg=tcfg, ctx=ctx) for step in range(start, num_steps)), device)
    model.train()
    metrics.reset_clock(start)
    # Only the run phase stops early to save. The check reads a flag on the host, a graph of its own on XLA:
    # there it runs at log steps only.
    stopwatch = None if phase != "run" else StopWatch(
        run_dir=run_dir, time_budget_min=cfg.checkpoint.time_budget_min, is_first_rank=ctx.is_first_rank,
        check_every=tcfg.log_interval if device.kind == "xla" else 1, device=device.device)
    try:
        for step, batches in zip(range(start, num_steps), feed):
            # The schedule always spans the run phase, so a compile trial traces the run's LR values.
            lr = lr_at(skips.applied, optim=cfg.optim, num_steps=tcfg.num_steps,
                       global_batch_size=tcfg.global_batch_size)
            set_lr(optimizer, lr)
            result = train_step(step_model, optimizer, batches, ctx=ctx, clip_grad=cfg.optim.clip_grad,
                                autocast_dtype=autocast_dtype, device_type=device.kind, scaler=scaler,
                                grad_reducer=grad_reducer, grad_bucket_mb=cfg.parallel.grad_bucket_mb)
            iteration = step + 1
            skips.add(result, iteration=iteration, lr=lr)
            interval.add(result)
            if metrics.should_log(iteration):
                stats = interval.reduced(group=ctx.dp_group)
                # The values reach the host after this step's graph ran (a step closure on XLA).
                when_step_done(device, _log_step, metrics, records, iteration, lr, stats, result.grad_norm,
                               iteration - metrics.last_iteration, ctx.dp_size, result.loss_scale)
                interval.reset()
            step_barrier(device)
            evaluator.maybe_evaluate(iteration, model)
            if ckpt.save_due(iteration, num_steps=num_steps):
                skips.settle()  # XLA: this step's flag, so the saved count is exact (a host sync, saves only)
            ckpt.lr_steps = skips.applied
            ckpt.maybe_save(step + 1, model=model, optimizer=optimizer, num_steps=num_steps)
            stopped = stopwatch.check(iteration) if stopwatch is not None and iteration < num_steps else None
            if stopped is not None:
                skips.settle()
                ckpt.lr_steps = skips.applied
                _stop_early(stopped, ckpt=ckpt, model=model, optimizer=optimizer, run_dir=run_dir,
                            first_rank=ctx.is_first_rank, out=out)
                break
        else:
            skips.settle()  # XLA: the last step's flag, which no later step reads
    finally:  # on an error too: the signal handlers go back and the event files are flushed
        if stopwatch is not None:
            stopwatch.close()
        metrics.close()
    steps = stopped.iteration if stopped is not None else num_steps
    return TrainSummary(steps=steps, consumed_samples=steps * tcfg.global_batch_size, records=records,
                        stopped=stopped)


def _host_batches(data: SyntheticTokens | IndexedBatches, step: int, *, cfg: TrainConfig,
                  ctx: ParallelContext) -> list[torch.Tensor]:
    """This rank's micro-batches of optimizer step `step`, on the CPU."""
    num_micro = cfg.global_batch_size // (cfg.micro_batch_size * ctx.dp_size)
    return [data.batch(micro_batch_indices(step, micro=m, micro_batch_size=cfg.micro_batch_size,
                                           global_batch_size=cfg.global_batch_size, dp_rank=ctx.dp_rank,
                                           dp_size=ctx.dp_size)) for m in range(num_micro)]


def _banner(cfg: RunConfig, ctx: ParallelContext, *, model: GPT, padded: int, device: DeviceInfo, phase: Phase,
            num_steps: int, autocast_dtype: torch.dtype | None) -> str:
    tcfg = cfg.train
    num_micro = tcfg.global_batch_size // (tcfg.micro_batch_size * ctx.dp_size)
    return (f"> megatron-hpc {phase}: world {ctx.world_size} = {ctx.mesh.num_nodes} node(s) x "
            f"{ctx.mesh.workers_per_node} worker(s) | tp {ctx.tp_size} dp {ctx.dp_size} | "
            f"parameters {model.num_params(ctx=ctx):,} | padded vocab {padded} "
            f"({padded - cfg.model.vocab_size} dummy) | {num_micro} micro-batch(es) of "
            f"{tcfg.micro_batch_size} | {device.kind} "
            f"{compute_label(tcfg.precision, float_dtype=device.float_dtype, autocast_dtype=autocast_dtype)} | "
            f"{num_steps} steps")


class _IntervalSums:
    """The log interval's loss sum over the steps taken, its NaN count and its skipped steps (device tensors: on
    XLA whether a step was skipped is known on the device only)."""

    def __init__(self, *, device: torch.device):
        self.loss_sum = torch.zeros((), device=device)
        self.nan_count = torch.zeros((), device=device)
        self.skipped = torch.zeros((), device=device)

    def add(self, result: StepOutput) -> None:
        # Megatron averages the loss over the steps it took.
        self.loss_sum += torch.where(result.finite, result.loss, torch.zeros_like(result.loss))
        self.nan_count += (~torch.isfinite(result.loss)).float()
        self.skipped += (~result.finite).float()

    def reduced(self, *, group: dist.ProcessGroup) -> torch.Tensor:
        """[loss sum, NaN count, skipped count] summed over the DP group, on the device."""
        stats = torch.stack([self.loss_sum, self.nan_count, self.skipped])
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        return stats

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.nan_count.zero_()
        self.skipped.zero_()


def _log_step(metrics: MetricsLogger, records: list[IterationRecord], iteration: int, lr: float,
              stats: torch.Tensor, grad_norm: torch.Tensor, steps: int, dp_size: int, loss_scale: float) -> None:
    """The iteration line and its records, from the interval's reduced sums (host sync: read as numbers)."""
    loss_total, nans, skipped_sum = stats.tolist()
    skipped = round(skipped_sum / dp_size)  # every DP rank skips the same steps
    taken = steps - skipped
    lm_loss = loss_total / (dp_size * taken) if taken else math.nan
    records.append(metrics.log(iteration, lr=lr, lm_loss=lm_loss, grad_norm=grad_norm.item(),
                               num_nan=round(nans / dp_size), num_skipped=skipped, loss_scale=loss_scale))


def _stop_early(decision: StopDecision, *, ckpt: Checkpointer, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, run_dir: Path | None, first_rank: bool, out: TextIO) -> None:
    """Save at the agreed iteration, then leave a stopped.json for the node task (which requeues)."""
    folder = ckpt.save_now(decision.iteration, model=model, optimizer=optimizer)
    if not first_rank:
        return
    where = f"checkpoint {folder}" if folder else "no checkpoint (no save folder)"
    print(f"> stopping at iteration {decision.iteration} on {decision.reason}: {where}", file=out, flush=True)
    if run_dir is not None:
        record_stop(run_dir, decision, checkpoint=folder)
