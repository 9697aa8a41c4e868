"""train(spec, ctx): build the model, optimizer and data, then step, log, repeat (nanoGPT's train.py)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

import torch
import torch.distributed as dist

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.data.loader import IndexedBatches, build_indexed_batches, check_vocabulary
from megatron_hpc.data.synthetic import SyntheticTokens
from megatron_hpc.model.gpt import GPT
from megatron_hpc.model.init_skip import skip_random_init
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceFeed, DeviceInfo, seed_everything, step_barrier, when_step_done
from megatron_hpc.parallel.grads import build_grad_reducer
from megatron_hpc.parallel.pipeline import PipelineRunner, to_all_stages
from megatron_hpc.plan.memory import xla_fp32_master
from megatron_hpc.plan.model_math import num_parameters
from megatron_hpc.plan.planner import Plan
from megatron_hpc.plan.spec import RunSpec
from megatron_hpc.plan.stages import StageLayout, rank_stages, stage_layouts_of
from megatron_hpc.train.checkpointing import Checkpointer, checkpoint_roots
from megatron_hpc.train.distributed_optimizer import DistributedOptimizer
from megatron_hpc.train.evaluate import build_evaluator
from megatron_hpc.train.lr import lr_at_count
from megatron_hpc.train.metrics import IterationRecord, MetricsLogger
from megatron_hpc.train.optim import build_optimizer, set_lr
from megatron_hpc.train.precision import autocast_dtype_for, build_loss_scaler, compute_label
from megatron_hpc.train.state import TrainState
from megatron_hpc.train.step import SkipTracker, StepOutput, train_step
from megatron_hpc.train.stop import StopDecision, StopWatch, record_stop
from megatron_hpc.train.tensorboard import open_tensorboard
from megatron_hpc.train.xla_zero import XlaZeroOptimizer

Phase = Literal["compile", "run"]
PP_SEED_STRIDE = 1_000_003
SP_SEED_STRIDE = 7_919  # a prime, clear of DP's +1 steps for any realistic DP size


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


def build_model(model_cfg: ModelConfig, ctx: ParallelContext, *, padded_vocab: int, seed: int,
                device: torch.device, from_checkpoint: bool = False,
                stages: list[StageLayout] | None = None, sequence_parallel: bool = False) -> GPT:
    """The GPT for this rank, on `device`, with the plan's padded vocabulary: the whole model, or this pipeline
    rank's `stages`.

    With from_checkpoint, the weights are left uninitialised: the caller loads them next.
    """
    # Built on the CPU (TP- and PP-invariant init: every weight is drawn by its name) and then moved, like
    # Megatron's --use-cpu-initialization.
    with skip_random_init(from_checkpoint):
        model = GPT(model_cfg, ctx=ctx, padded_vocab=padded_vocab, seed=seed, stages=stages,
                    sequence_parallel=sequence_parallel)
    return model.to(device)


def pipeline_stages(plan: Plan, ctx: ParallelContext) -> list[StageLayout] | None:
    """This pipeline rank's virtual stages, from the plan's layer split (None without pipelining: the whole
    model)."""
    if ctx.pp_size == 1:
        return None
    return rank_stages(stage_layouts_of(plan.stage_ranges, pipeline=ctx.pp_size), ctx.pp_rank)


def _build_data(spec: RunSpec, ctx: ParallelContext) -> SyntheticTokens | IndexedBatches:
    """The token source; both give `.batch(indices)` -> (len, seq_length + 1) int64."""
    cfg, plan = spec.config, spec.plan
    if plan.data_source == "synthetic":
        return SyntheticTokens(vocab_size=cfg.model.vocab_size, seq_length=plan.seq_length, seed=cfg.train.seed)
    if cfg.data.path and ctx.is_first_rank:
        # One full read of every .bin is enough: rank 0's DataError ends the whole torchrun job.
        check_vocabulary(cfg.data.path, vocab_size=cfg.model.vocab_size)
    # Always the run phase's sample count, so a compile trial builds the run's index cache.
    return build_indexed_batches(cfg.data, seq_length=plan.seq_length, seed=cfg.train.seed,
                                 num_steps=cfg.train.num_steps, layout=plan.batch, dp_rank=ctx.dp_rank)


def train(spec: RunSpec, ctx: ParallelContext, *, device: DeviceInfo, phase: Phase = "run",
          run_dir: Path | None = None, checkpoints: bool = True, out: TextIO | None = None) -> TrainSummary:
    """Train for train.num_steps (phase run) or compile.num_steps (phase compile) steps.

    Every derived number (mesh, batch split, padded vocabulary, LR schedule) comes from spec.plan.
    `checkpoints` False (a compile trial) neither loads nor saves.
    """
    out = sys.stdout if out is None else out  # looked up per call, so redirection and capture work
    cfg, plan, tcfg = spec.config, spec.plan, spec.config.train
    num_steps = tcfg.num_steps if phase == "run" else cfg.compile.num_steps
    data = _build_data(spec, ctx)  # before the model: data errors surface first
    fp32_master = xla_fp32_master(backend=device.kind, distributed_optimizer=cfg.parallel.distributed_optimizer)
    autocast_dtype = autocast_dtype_for(tcfg.precision, device_kind=device.kind, float_dtype=device.float_dtype,
                                        fp32_master=fp32_master)
    # Dropout masks: the same across TP, different across DP and across pipeline stages (Megatron offsets the seed
    # by 100 per pipeline rank; a larger stride here keeps the offsets clear of DP's). With sequence parallelism
    # every dropout acts on a TP shard (sequence or heads), so TP ranks take their own seeds too: the same seed
    # would give each sequence shard the same mask. Weights and data do not draw from this RNG.
    tp_offset = SP_SEED_STRIDE * ctx.tp_rank if cfg.parallel.sequence_parallel else 0
    seed_everything(device, tcfg.seed + ctx.dp_rank + PP_SEED_STRIDE * ctx.pp_rank + tp_offset)

    save_root, load_root = checkpoint_roots(cfg.checkpoint, run_dir=run_dir, active=checkpoints)
    ckpt = Checkpointer(spec, ctx, device=device, save_root=save_root, load_root=load_root, out=out)
    resuming = ckpt.has_checkpoint()  # then the random init would be thrown away: skip it
    model = build_model(cfg.model, ctx, padded_vocab=plan.padded_vocab_size, seed=tcfg.seed, device=device.device,
                        from_checkpoint=resuming, stages=pipeline_stages(plan, ctx),
                        sequence_parallel=cfg.parallel.sequence_parallel)
    if fp32_master and tcfg.precision == "bf16":
        model.to(torch.bfloat16)  # bf16 weights, fp32 masters in the optimizer (train/xla_zero.py)
    if ctx.is_first_rank:
        print(_banner(spec, ctx, model=model, device=device, phase=phase, num_steps=num_steps,
                      autocast_dtype=autocast_dtype), file=out, flush=True)
    pipeline = None
    if ctx.pp_size > 1:
        pipeline = PipelineRunner(model, ctx, num_micro_batches=plan.num_micro_batches,
                                  schedule=plan.pipeline_schedule, device=device.device,
                                  compile_chunks=tcfg.compile and device.kind != "xla",
                                  compile_backend=tcfg.compile_backend)
    compiled = tcfg.compile and device.kind != "xla" and pipeline is None
    step_model = torch.compile(model, backend=tcfg.compile_backend) if compiled else model
    # The distributed optimizer overlaps its reduce-scatter with backward as the plain path's reducer does (not under
    # pipelining); on XLA it is torch_xla's ZeRO-1 with fp32 masters (train/xla_zero.py), which reduces after it.
    optimizer: torch.optim.Optimizer | DistributedOptimizer | XlaZeroOptimizer
    if fp32_master:  # on XLA: torch_xla's ZeRO-1
        optimizer = XlaZeroOptimizer(model, optim=cfg.optim, ctx=ctx)
    elif cfg.parallel.distributed_optimizer:
        optimizer = DistributedOptimizer(model, optim=cfg.optim, group=ctx.dp_group,
                                         bucket_mb=cfg.parallel.grad_bucket_mb,
                                         overlap=cfg.parallel.overlap_grad_reduce and pipeline is None,
                                         overlap_param_gather=cfg.parallel.overlap_param_gather and pipeline is None)
        if not compiled:  # a compiled model would trace the waits: train_step waits before its forward instead
            optimizer.wait_in_forward(model)
    else:
        optimizer = build_optimizer(model, optim=cfg.optim)
    if fp32_master and cfg.parallel.overlap_param_gather and ctx.is_first_rank:
        print("megatron-hpc: warning: parallel.overlap_param_gather ignored on XLA: torch_xla's ZeRO-1 all-gathers "
              "inside the step's graph, where the compiler schedules it", file=sys.stderr, flush=True)
    state = ckpt.restore(model, optimizer, TrainState(scaler=build_loss_scaler(tcfg.precision)))
    start = state.step
    metrics = MetricsLogger(model=cfg.model, padded_vocab=plan.padded_vocab_size, world_size=ctx.world_size,
                            train_iters=num_steps, global_batch_size=plan.global_batch_size, phase=phase,
                            log_interval=tcfg.log_interval, enabled=ctx.is_last_rank, run_dir=run_dir, out=out)
    metrics.tensorboard = open_tensorboard(run_dir, enabled=ctx.is_last_rank and tcfg.tensorboard,
                                           platform=plan.platform, device=device.device)
    evaluator = build_evaluator(tcfg, cfg.data, vocab_size=cfg.model.vocab_size, plan=plan, ctx=ctx, device=device,
                                autocast_dtype=autocast_dtype, train_iters=num_steps, metrics=metrics,
                                pipeline=pipeline)
    records: list[IterationRecord] = []
    interval = _IntervalSums(device=device.device)
    # Counts the applied steps into state.lr_steps (the LR advances only on those, as Megatron's scheduler does)
    # and stops a streak of non-finite steps; on XLA one step late, without a host sync.
    skips = SkipTracker(device, optimizer, state=state, limit=tcfg.max_skipped_steps, phase=phase)
    stopped: StopDecision | None = None
    # DP all-reduce started inside the last micro-batch's backward (None: after it; see parallel/grads.py).
    # Not under pipelining: the schedule runs the last micro-batch's backward, where the reducer would arm. Not with
    # the distributed optimizer, which reduce-scatters instead.
    grad_reducer = build_grad_reducer(model.parameters(), group=ctx.dp_group, device_kind=device.kind,
                                      overlap=(cfg.parallel.overlap_grad_reduce and pipeline is None
                                               and not cfg.parallel.distributed_optimizer),
                                      bucket_mb=cfg.parallel.grad_bucket_mb)
    feed = DeviceFeed((_host_batches(data, step, plan=plan, ctx=ctx) for step in range(start, num_steps)), device)
    model.train()
    metrics.reset_clock(start)
    # Only the run phase stops early to save. The check reads a flag on the host, a graph of its own on XLA:
    # there it runs at log steps only.
    stopwatch = None if phase != "run" else StopWatch(
        run_dir=run_dir, time_budget_min=cfg.checkpoint.time_budget_min, is_first_rank=ctx.is_first_rank,
        check_every=tcfg.log_interval if device.kind == "xla" else 1, device=device.device)
    try:
        for batches in feed:
            # The schedule (from the plan) always spans the run phase, so a compile trial traces the run's LRs.
            lr = lr_at_count(state.lr_steps * plan.lr_schedule.per_step, sched=plan.lr_schedule, optim=cfg.optim)
            set_lr(optimizer, lr)
            result = train_step(step_model, optimizer, batches, ctx=ctx, clip_grad=cfg.optim.clip_grad,
                                autocast_dtype=autocast_dtype, device_type=device.kind, scaler=state.scaler,
                                grad_reducer=grad_reducer, grad_bucket_mb=cfg.parallel.grad_bucket_mb,
                                pipeline=pipeline)
            state.advance(global_batch_size=plan.global_batch_size)
            iteration = state.step
            skips.add(result, iteration=iteration, lr=lr)
            interval.add(result)
            if metrics.should_log(iteration):
                stats = interval.reduced(ctx)
                # The values reach the host after this step's graph ran (a step closure on XLA).
                when_step_done(device, _log_step, metrics, records, iteration, lr, stats, result.grad_norm,
                               iteration - metrics.last_iteration, ctx.dp_size, result.loss_scale)
                interval.reset()
            step_barrier(device)
            if (iteration == num_steps or evaluator.should_evaluate(iteration)
                    or ckpt.save_due(state.step, num_steps=num_steps)):
                _weights_updated(optimizer)  # what follows reads the weights outside a training forward
            evaluator.maybe_evaluate(iteration, model)
            if ckpt.save_due(state.step, num_steps=num_steps):
                skips.settle()  # XLA: this step's flag, so the saved count is exact (a host sync, saves only)
            ckpt.maybe_save(state, model=model, optimizer=optimizer, num_steps=num_steps)
            stopped = stopwatch.check(iteration) if stopwatch is not None and iteration < num_steps else None
            if stopped is not None:
                skips.settle()
                _weights_updated(optimizer)
                _stop_early(stopped, state, ckpt=ckpt, model=model, optimizer=optimizer, run_dir=run_dir,
                            first_rank=ctx.is_first_rank, out=out)
                break
        else:
            skips.settle()  # XLA: the last step's flag, which no later step reads
            if phase == "run":  # Megatron's do_test: the test split once, after training (not after an early stop)
                evaluator.evaluate_test(state.step, model)
        _weights_updated(optimizer)  # the caller may read the weights
        ckpt.wait_for_save()  # checkpoint.async_save: the last save is complete (tracker written) before we return
    finally:  # on an error too: the signal handlers go back and the event files are flushed
        ckpt.abandon_save()  # an error path: this rank's writer finishes its files, uncommitted (no collective)
        if stopwatch is not None:
            stopwatch.close()
        metrics.close()
    return TrainSummary(steps=state.step, consumed_samples=state.consumed_samples, records=records, stopped=stopped)


def _weights_updated(optimizer: torch.optim.Optimizer | DistributedOptimizer | XlaZeroOptimizer) -> None:
    """The distributed optimizer's all-gathers still in flight (parallel.overlap_param_gather) are done."""
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.finish_param_gather()


def _host_batches(data: SyntheticTokens | IndexedBatches, step: int, *, plan: Plan,
                  ctx: ParallelContext) -> list[torch.Tensor]:
    """This rank's micro-batches of optimizer step `step`, on the CPU."""
    return [data.batch(ids) for ids in plan.batch.rank_indices(step, dp_rank=ctx.dp_rank)]


def _banner(spec: RunSpec, ctx: ParallelContext, *, model: GPT, device: DeviceInfo, phase: Phase,
            num_steps: int, autocast_dtype: torch.dtype | None) -> str:
    plan, vocab = spec.plan, spec.config.model.vocab_size
    label = compute_label(spec.config.train.precision, float_dtype=device.float_dtype, autocast_dtype=autocast_dtype,
                          fp32_master=xla_fp32_master(backend=device.kind,
                                                      distributed_optimizer=plan.distributed_optimizer))
    data = "indexed data"
    if plan.data_source == "synthetic":  # loudly where hours are spent: never real data, whatever the loss says
        data = "synthetic tokens" if plan.platform == "cpu" else "SYNTHETIC TOKENS, NOT REAL DATA (data.source)"
    return (f"> megatron-hpc {phase}: world {ctx.world_size} = {ctx.mesh.num_nodes} node(s) x "
            f"{ctx.mesh.workers_per_node} worker(s) | tp {ctx.tp_size} pp {ctx.pp_size} dp {ctx.dp_size}"
            f"{' (Adam state sharded over dp)' if plan.distributed_optimizer else ''} | "
            f"parameters {_param_count(spec, ctx, model)} | padded vocab {plan.padded_vocab_size} "
            f"({plan.padded_vocab_size - vocab} dummy) | {plan.num_micro_batches} micro-batch(es) of "
            f"{plan.micro_batch_size} | {device.kind} {label} | {num_steps} steps | {data}")


def _param_count(spec: RunSpec, ctx: ParallelContext, model: GPT) -> str:
    if ctx.pp_size == 1:
        return f"{model.num_params(ctx=ctx):,}"
    whole = num_parameters(spec.config.model, padded_vocab=spec.plan.padded_vocab_size)
    return f"{whole:,} ({model.num_params(ctx=ctx):,} on pipeline rank {ctx.pp_rank})"


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

    def reduced(self, ctx: ParallelContext) -> torch.Tensor:
        """[loss sum, NaN count, skipped count] summed over the DP group, on the device; every pipeline stage gets
        the last stage's loss sums (the others hold zeros there) and the skip count, the same on all stages."""
        stats = torch.stack([self.loss_sum, self.nan_count, self.skipped])
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=ctx.dp_group)
        if ctx.pp_size > 1:
            losses = to_all_stages(stats[:2].clone(), ctx)
            stats = torch.cat([losses, stats[2:]])
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


def _stop_early(decision: StopDecision, state: TrainState, *, ckpt: Checkpointer, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, run_dir: Path | None, first_rank: bool, out: TextIO) -> None:
    """Save at the agreed iteration, then leave a stopped.json for the node task (which requeues)."""
    folder = ckpt.save_now(state, model=model, optimizer=optimizer, wait=True)  # complete before stopped.json
    if not first_rank:
        return
    where = f"checkpoint {folder}" if folder else "no checkpoint (no save folder)"
    print(f"> stopping at iteration {decision.iteration} on {decision.reason}: {where}", file=out, flush=True)
    if run_dir is not None:
        record_stop(run_dir, decision, checkpoint=folder)
