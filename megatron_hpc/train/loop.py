"""train(spec, ctx): build the data, the model and its optimizer, restore, then step, log, evaluate, save, repeat
(nanoGPT's train.py; torchtitan's Trainer.train)."""

from __future__ import annotations

import math
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

import torch
import torch.distributed as dist

from megatron_hpc.config.schema import ModelConfig, Precision, RunConfig
from megatron_hpc.data.loader import IndexedBatches, build_indexed_batches, check_vocabulary
from megatron_hpc.data.synthetic import SyntheticTokens
from megatron_hpc.heartbeat import HeartbeatWriter
from megatron_hpc.model.gpt import GPT
from megatron_hpc.model.init_skip import skip_random_init
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceFeed, DeviceInfo, seed_everything, step_barrier, when_step_done
from megatron_hpc.parallel.pipeline import PipelineRunner, to_all_stages
from megatron_hpc.plan.model_math import num_parameters
from megatron_hpc.plan.planner import Plan
from megatron_hpc.plan.spec import RunSpec
from megatron_hpc.plan.stages import StageLayout, rank_stages, stage_layouts_of
from megatron_hpc.train.checkpointing import Checkpointer, checkpoint_roots
from megatron_hpc.train.evaluate import Evaluator, build_evaluator
from megatron_hpc.train.lr import lr_at_count
from megatron_hpc.train.metrics import IterationRecord, MetricsLogger
from megatron_hpc.train.optimizer import TrainOptimizer, build_optimizer
from megatron_hpc.train.precision import autocast_dtype_for, build_loss_scaler, compute_label
from megatron_hpc.train.pulse import Pulse
from megatron_hpc.train.state import TrainState
from megatron_hpc.train.step import (
    ForwardBackward,
    MicroBatches,
    PipelineSchedule,
    SkipTracker,
    StepOutput,
    train_step,
)
from megatron_hpc.train.stop import StopDecision, StopWatch, record_stop
from megatron_hpc.train.stragglers import RankNodes, Stragglers, knobs_for_tests
from megatron_hpc.train.tensorboard import open_tensorboard

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

    Every derived number (mesh, batch split, padded vocabulary, LR schedule, fp32 masters) comes from spec.plan.
    `checkpoints` False (a compile trial) neither loads nor saves.
    """
    out = sys.stdout if out is None else out  # looked up per call, so redirection and capture work
    cfg, plan = spec.config, spec.plan
    num_steps = cfg.train.num_steps if phase == "run" else cfg.compile.num_steps
    data = _build_data(spec, ctx)  # before the model: data errors surface first
    _seed_dropout(spec, ctx, device)
    ckpt = _build_checkpointer(spec, ctx, device=device, run_dir=run_dir, active=checkpoints, out=out)
    pulse = _build_pulse(spec, ctx, device=device, phase=phase, run_dir=run_dir)
    rank = _build_rank(spec, ctx, device=device, from_checkpoint=ckpt.has_checkpoint(), pulse=pulse)
    if ctx.is_first_rank:
        print(_banner(spec, ctx, rank=rank, device=device, phase=phase, num_steps=num_steps), file=out, flush=True)
    state = _restore(ckpt, rank, pulse, precision=cfg.train.precision)
    log = _build_log(spec, ctx, pulse, device=device, phase=phase, num_steps=num_steps, run_dir=run_dir, out=out)
    evaluator = build_evaluator(cfg.train, cfg.data, vocab_size=cfg.model.vocab_size, plan=plan, ctx=ctx,
                                device=device, autocast_dtype=rank.autocast_dtype, train_iters=num_steps,
                                metrics=log.metrics, pipeline=rank.pipeline)
    # Counts the applied steps into state.lr_steps (the LR advances only on those, as Megatron's scheduler does)
    # and stops a streak of non-finite steps; on XLA one step late, without a host sync.
    skips = SkipTracker(device, rank.optimizer, state=state, limit=cfg.train.max_skipped_steps, phase=phase)
    feed = DeviceFeed((_host_batches(data, step, plan=plan, ctx=ctx) for step in range(state.step, num_steps)), device)
    rank.model.train()
    log.metrics.reset_clock(state.step)
    ends = _StepEnds(rank=rank, evaluator=evaluator, ckpt=ckpt, skips=skips, num_steps=num_steps, run_dir=run_dir,
                     first_rank=ctx.is_first_rank, out=out, pulse=pulse,
                     stopwatch=_build_stopwatch(spec, ctx, device=device, phase=phase, run_dir=run_dir))
    stopped: StopDecision | None = None
    try:
        for batches in feed:
            lr = _scheduler_lr(state, plan, cfg)
            rank.optimizer.set_lr(lr)
            pulse.step_begins(state.step + 1)
            result = train_step(rank.forward_backward, rank.optimizer, batches, scaler=state.scaler)
            state.advance(global_batch_size=plan.global_batch_size)
            pulse.step_ends()
            skips.add(result, iteration=state.step, lr=lr)
            log.add(result, iteration=state.step, lr=_scheduler_lr(state, plan, cfg), applied_lr=lr)
            step_barrier(device)
            stopped = ends.after_step(state)
            if stopped is not None:
                break
        else:
            skips.settle()  # XLA: the last step's flag, which no later step reads
            if phase == "run":  # Megatron's do_test: the test split once, after training (not after an early stop)
                evaluator.evaluate_test(state.step, rank.model)
        rank.optimizer.wait_for_weights()  # the caller may read the weights
        ckpt.wait_for_save()  # checkpoint.async_save: the last save is complete (tracker written) before we return
    finally:  # on an error too: the signal handlers go back and the event files are flushed
        ckpt.abandon_save()  # an error path: this rank's writer finishes its files, uncommitted (no collective)
        ends.close()
        log.metrics.close()
    return TrainSummary(steps=state.step, consumed_samples=state.consumed_samples, records=log.records,
                        stopped=stopped)


@dataclass(frozen=True, slots=True)
class _Rank:
    """What this rank trains, built once from the plan (`_build_rank`)."""

    model: GPT
    forward_backward: ForwardBackward
    """The micro-batches through the model in turn (under torch.compile with train.compile), or the pipeline
    schedule; the pulse marks where it ends (train/pulse.py)."""
    optimizer: TrainOptimizer
    pipeline: PipelineRunner | None
    """This pipeline rank's schedule runner (evaluation runs through it too); None without pipelining."""
    autocast_dtype: torch.dtype | None


def _build_rank(spec: RunSpec, ctx: ParallelContext, *, device: DeviceInfo, from_checkpoint: bool,
                pulse: Pulse) -> _Rank:
    """This rank's model, how its micro-batches run, and its optimizer. With from_checkpoint the random init is
    skipped: the restore overwrites it."""
    tcfg, plan = spec.config.train, spec.plan
    autocast = autocast_dtype_for(tcfg.precision, device_kind=device.kind, float_dtype=device.float_dtype,
                                  fp32_master=plan.fp32_master)  # first: it refuses fp16 on XLA
    model = build_model(spec.config.model, ctx, padded_vocab=plan.padded_vocab_size, seed=tcfg.seed,
                        device=device.device, from_checkpoint=from_checkpoint, stages=pipeline_stages(plan, ctx),
                        sequence_parallel=spec.config.parallel.sequence_parallel)
    if plan.fp32_master and tcfg.precision == "bf16":
        model.to(torch.bfloat16)  # bf16 weights, fp32 masters in the optimizer (train/xla_zero.py)
    pipeline = None if ctx.pp_size == 1 else PipelineRunner(
        model, ctx, num_micro_batches=plan.num_micro_batches, schedule=plan.pipeline_schedule, device=device.device,
        compile_chunks=tcfg.compile and device.kind != "xla", compile_backend=tcfg.compile_backend)
    compiled = tcfg.compile and device.kind != "xla" and pipeline is None
    step_model = torch.compile(model, backend=tcfg.compile_backend) if compiled else model
    forward_backward: ForwardBackward = (
        MicroBatches(step_model, ctx=ctx, autocast_dtype=autocast, device_type=device.kind) if pipeline is None
        else PipelineSchedule(pipeline, autocast_dtype=autocast, device_type=device.kind))
    return _Rank(model=model, forward_backward=pulse.timed(forward_backward), pipeline=pipeline,
                 autocast_dtype=autocast, optimizer=build_optimizer(spec, ctx, model, device=device, compiled=compiled))


def _seed_dropout(spec: RunSpec, ctx: ParallelContext, device: DeviceInfo) -> None:
    """Dropout masks: the same across TP, different across DP and across pipeline stages (Megatron offsets the seed
    by 100 per pipeline rank; a larger stride here keeps the offsets clear of DP's). With sequence parallelism
    every dropout acts on a TP shard (sequence or heads), so TP ranks take their own seeds too: the same seed
    would give each sequence shard the same mask. Weights and data do not draw from this RNG."""
    tp_offset = SP_SEED_STRIDE * ctx.tp_rank if spec.config.parallel.sequence_parallel else 0
    seed_everything(device, spec.config.train.seed + ctx.dp_rank + PP_SEED_STRIDE * ctx.pp_rank + tp_offset)


def _build_checkpointer(spec: RunSpec, ctx: ParallelContext, *, device: DeviceInfo, run_dir: Path | None,
                        active: bool, out: TextIO) -> Checkpointer:
    save_root, load_root = checkpoint_roots(spec.config.checkpoint, run_dir=run_dir, active=active)
    return Checkpointer(spec, ctx, device=device, save_root=save_root, load_root=load_root, out=out)


def _build_metrics(spec: RunSpec, ctx: ParallelContext, *, device: DeviceInfo, phase: Phase, num_steps: int,
                   run_dir: Path | None, out: TextIO) -> MetricsLogger:
    """The iteration line and metrics.jsonl on the last rank (which holds the loss), with TensorBoard's events."""
    plan, tcfg = spec.plan, spec.config.train
    metrics = MetricsLogger(model=spec.config.model, padded_vocab=plan.padded_vocab_size, world_size=ctx.world_size,
                            train_iters=num_steps, global_batch_size=plan.global_batch_size, phase=phase,
                            log_interval=tcfg.log_interval, enabled=ctx.is_last_rank, run_dir=run_dir, out=out)
    metrics.tensorboard = open_tensorboard(run_dir, enabled=ctx.is_last_rank and tcfg.tensorboard,
                                           peak_tflops=plan.peak_tflops_per_worker, device=device.device)
    return metrics


def _restore(ckpt: Checkpointer, rank: _Rank, pulse: Pulse, *, precision: Precision) -> TrainState:
    """The newest checkpoint's state (a fresh one without); the steps after it are the pulse's warm-up."""
    pulse.beat("load", 0)
    state = ckpt.restore(rank.model, rank.optimizer, TrainState(scaler=build_loss_scaler(precision)))
    pulse.starts_at(state.step)
    return state


def _build_log(spec: RunSpec, ctx: ParallelContext, pulse: Pulse, *, device: DeviceInfo, phase: Phase,
               num_steps: int, run_dir: Path | None, out: TextIO) -> _StepLog:
    log = _StepLog(_build_metrics(spec, ctx, device=device, phase=phase, num_steps=num_steps, run_dir=run_dir,
                                  out=out), ctx=ctx, device=device)
    log.stragglers = _build_stragglers(spec, ctx, pulse, device=device, run_dir=run_dir, metrics=log.metrics, out=out)
    return log


def _build_pulse(spec: RunSpec, ctx: ParallelContext, *, device: DeviceInfo, phase: Phase,
                 run_dir: Path | None) -> Pulse:
    """This rank's heartbeat (with a run folder) and step timing. Only the run phase has a watchdog, so only it
    holds a step to launch.hang_timeout_s."""
    writer = HeartbeatWriter(run_dir, ctx.rank, host=socket.gethostname()) if run_dir is not None else None
    world_max = world_max_over_ranks(device) if dist.is_initialized() and dist.get_world_size() > 1 else None
    return Pulse(writer, rank=ctx.rank, device=device.device, slowdown=knobs_for_tests().slowdown,
                 hang_timeout_s=spec.config.launch.hang_timeout_s if phase == "run" else None, world_max=world_max)


def world_max_over_ranks(device: DeviceInfo) -> Callable[[float], float]:
    """The largest of every rank's value, over the world group on the training device (read on the host)."""
    def world_max(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64 if device.kind != "xla" else torch.float32,
                         device=device.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())
    return world_max


def _build_stragglers(spec: RunSpec, ctx: ParallelContext, pulse: Pulse, *, device: DeviceInfo,
                      run_dir: Path | None, metrics: MetricsLogger, out: TextIO) -> Stragglers:
    """The log step's gather on every rank; the naming on the last rank, next to the metrics."""
    nodes = RankNodes.of(rank=ctx.rank, world_size=ctx.world_size, workers_per_node=ctx.mesh.workers_per_node,
                         knobs=knobs_for_tests())
    stragglers = Stragglers(pulse, nodes, device=device, threshold=spec.config.launch.straggler_threshold,
                            run_dir=run_dir, enabled=ctx.is_last_rank, out=out)
    stragglers.tensorboard = metrics.tensorboard
    return stragglers


def _build_stopwatch(spec: RunSpec, ctx: ParallelContext, *, device: DeviceInfo, phase: Phase,
                     run_dir: Path | None) -> StopWatch | None:
    """Only the run phase stops early to save. The check reads a flag on the host, a graph of its own on XLA:
    there it runs at log steps only."""
    if phase != "run":
        return None
    return StopWatch(run_dir=run_dir, time_budget_min=spec.config.checkpoint.time_budget_min,
                     is_first_rank=ctx.is_first_rank, device=device.device,
                     check_every=spec.config.train.log_interval if device.kind == "xla" else 1)


@dataclass(kw_only=True, slots=True)
class _StepEnds:
    """After each step, in this order: evaluation, the save, and the early stop (a signal or the time budget)."""

    rank: _Rank
    evaluator: Evaluator
    ckpt: Checkpointer
    skips: SkipTracker
    stopwatch: StopWatch | None
    num_steps: int
    run_dir: Path | None
    first_rank: bool
    out: TextIO
    pulse: Pulse

    def after_step(self, state: TrainState) -> StopDecision | None:
        """Evaluate and save when due; the stop decision when the run ends here (after its save)."""
        iteration, optimizer, model = state.step, self.rank.optimizer, self.rank.model
        save_due = self.ckpt.save_due(iteration, num_steps=self.num_steps)
        evaluating = self.evaluator.should_evaluate(iteration)
        if iteration == self.num_steps or evaluating or save_due:
            optimizer.wait_for_weights()  # what follows reads the weights outside a training forward
        if evaluating:
            self.pulse.beat("eval", iteration)  # longer than a step: the watchdog waits the collective timeout
        self.evaluator.maybe_evaluate(iteration, model)
        if save_due:
            self.pulse.beat("save", iteration)
            self.skips.settle()  # XLA: this step's flag, so the saved count is exact (a host sync, saves only)
        self.ckpt.maybe_save(state, model=model, optimizer=optimizer, num_steps=self.num_steps)
        if self.stopwatch is None or iteration >= self.num_steps:
            return None
        stopped = self.stopwatch.check(iteration)
        if stopped is not None:
            self.skips.settle()
            optimizer.wait_for_weights()
            self._stop_early(stopped, state)
        return stopped

    def _stop_early(self, decision: StopDecision, state: TrainState) -> None:
        """Save at the agreed iteration, then leave a stopped.json for the node task (which requeues)."""
        self.pulse.beat("save", state.step)
        folder = self.ckpt.save_now(state, model=self.rank.model, optimizer=self.rank.optimizer,
                                    wait=True)  # complete before stopped.json
        if not self.first_rank:
            return
        where = f"checkpoint {folder}" if folder else "no checkpoint (no save folder)"
        print(f"> stopping at iteration {decision.iteration} on {decision.reason}: {where}", file=self.out, flush=True)
        if self.run_dir is not None:
            record_stop(self.run_dir, decision, checkpoint=folder)

    def close(self) -> None:
        """The signal handlers go back; the heartbeat says done."""
        if self.stopwatch is not None:
            self.stopwatch.close()
        self.pulse.close()


def _host_batches(data: SyntheticTokens | IndexedBatches, step: int, *, plan: Plan,
                  ctx: ParallelContext) -> list[torch.Tensor]:
    """This rank's micro-batches of optimizer step `step`, on the CPU."""
    return [data.batch(ids) for ids in plan.batch.rank_indices(step, dp_rank=ctx.dp_rank)]


def _banner(spec: RunSpec, ctx: ParallelContext, *, rank: _Rank, device: DeviceInfo, phase: Phase,
            num_steps: int) -> str:
    plan, vocab = spec.plan, spec.config.model.vocab_size
    label = compute_label(spec.config.train.precision, float_dtype=device.float_dtype,
                          autocast_dtype=rank.autocast_dtype, fp32_master=plan.fp32_master)
    data = "indexed data"
    if plan.data_source == "synthetic":  # loudly where hours are spent: never real data, whatever the loss says
        data = "synthetic tokens" if plan.platform == "cpu" else "SYNTHETIC TOKENS, NOT REAL DATA (data.source)"
    return (f"> megatron-hpc {phase}: world {ctx.world_size} = {ctx.mesh.num_nodes} node(s) x "
            f"{ctx.mesh.workers_per_node} worker(s) | tp {ctx.tp_size} pp {ctx.pp_size} dp {ctx.dp_size}"
            f"{' (Adam state sharded over dp)' if plan.distributed_optimizer else ''} | "
            f"parameters {_param_count(spec, ctx, rank.model)} | padded vocab {plan.padded_vocab_size} "
            f"({plan.padded_vocab_size - vocab} dummy) | {plan.num_micro_batches} micro-batch(es) of "
            f"{plan.micro_batch_size} | {device.kind} {label} | {num_steps} steps | {data}")


def _param_count(spec: RunSpec, ctx: ParallelContext, model: GPT) -> str:
    if ctx.pp_size == 1:
        return f"{model.num_params(ctx=ctx):,}"
    whole = num_parameters(spec.config.model, padded_vocab=spec.plan.padded_vocab_size)
    return f"{whole:,} ({model.num_params(ctx=ctx):,} on pipeline rank {ctx.pp_rank})"


class _StepLog:
    """The log interval's sums and, at each log step, the iteration line and its record (metrics.maybe_log)."""

    def __init__(self, metrics: MetricsLogger, *, ctx: ParallelContext, device: DeviceInfo):
        self.metrics, self.ctx, self.device = metrics, ctx, device
        self.records: list[IterationRecord] = []
        """Every logged interval, on every rank (only the last rank prints them)."""
        self.sums = _IntervalSums(device=device.device)
        self.stragglers: Stragglers | None = None

    def add(self, result: StepOutput, *, iteration: int, lr: float, applied_lr: float) -> None:
        self.sums.add(result)
        if not self.metrics.should_log(iteration):
            return
        if self.stragglers is not None:
            self.stragglers.log_begins(iteration)
        stats = self.sums.reduced(self.ctx)
        # The values reach the host after this step's graph ran (a step closure on XLA).
        when_step_done(self.device, _log_step, self.metrics, self.records, iteration, (lr, applied_lr), stats,
                       result.grad_norm, iteration - self.metrics.last_iteration, self.ctx.dp_size, result.loss_scale)
        if self.stragglers is not None:  # after the iteration line, which its own line follows
            self.stragglers.at_log(iteration)
        self.sums.reset()


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


def _scheduler_lr(state: TrainState, plan: Plan, cfg: RunConfig) -> float:
    """The LR of Megatron's scheduler after `state.lr_steps` applied steps: the next step's. Read before a step, it
    is the LR the step applies; read after it, what Megatron logs for the step (its train_step steps the scheduler
    before training_log reads the param group; a skipped step leaves it, and on XLA the step in flight counts as
    applied until its flag is read, as in SkipTracker). The schedule (from the plan) always spans the run phase, so a
    compile trial traces the run's LRs."""
    return lr_at_count(state.lr_steps * plan.lr_schedule.per_step, sched=plan.lr_schedule, optim=cfg.optim)


def _log_step(metrics: MetricsLogger, records: list[IterationRecord], iteration: int, lrs: tuple[float, float],
              stats: torch.Tensor, grad_norm: torch.Tensor, steps: int, dp_size: int, loss_scale: float) -> None:
    """The iteration line and its records, from the interval's reduced sums (host sync: read as numbers)."""
    loss_total, nans, skipped_sum = stats.tolist()
    skipped = round(skipped_sum / dp_size)  # every DP rank skips the same steps
    taken = steps - skipped
    lm_loss = loss_total / (dp_size * taken) if taken else math.nan
    records.append(metrics.log(iteration, lr=lrs[0], applied_lr=lrs[1], lm_loss=lm_loss, grad_norm=grad_norm.item(),
                               num_nan=round(nans / dp_size), num_skipped=skipped, loss_scale=loss_scale))
