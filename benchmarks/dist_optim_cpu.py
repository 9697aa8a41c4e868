"""The distributed optimizer (ZeRO-1) against the plain one on the CPU: optimizer-state bytes and step time.

Issue 15's figures: at DP=2 and DP=4, Adam's state per rank should be 1/DP of the plain run's (within 5%) and the
step time at most 1.1x the plain run's. For each DP size one world of DP real processes over gloo (1 thread each:
OMP_NUM_THREADS and torch.set_num_threads; the VM has 2 cores, so DP=4 runs 2 processes per core) builds the same
GPT twice with the trainer's build_model (same seed, so the same weights) and runs megatron_hpc's train_step on
both, alternating step by step (plain, dist, dist, plain, plain, dist, ...) so that the shared machine's load hits
both modes alike:

- plain: train.optim.PlainOptimizer, with the DP all-reduce as train/optimizer.py builds it by default
  (parallel.overlap_grad_reduce on: the OverlappedGradReducer of parallel/grads.py, 128 MiB buckets);
- dist: train.distributed_optimizer.DistributedOptimizer(model, optim=..., ctx=ctx): on gloo an
  all-reduce of the flat gradient buffer in place (a reduce-scatter elsewhere), AdamW on this rank's slice, a
  broadcast per slice (an all-gather elsewhere); no grad reducer with it.

Each DP rank gets its own batch (the same for both modes), fp32, one micro-batch per step, clip 1.0, constant LR.
Every step is barrier-framed on all ranks; rank 0's times are reported after `--warmup` steps per mode: the medians
(whose ratio is the goal's), the best steps, and the median of the paired ratios (each iteration's dist step over
its plain step, run back to back). Optimizer-state bytes are counted per rank after the last step: the tensors of
the inner AdamW's .optimizer.state (over the slices for the distributed one), Adam's moments exp_avg and exp_avg_sq; the
scalar step counters (4 bytes per parameter or per owned piece) are counted apart and left out of the ratio.

Then, to show where the step's time goes, the same world times the parts in which the modes differ, each
barrier-framed and alternated the same way: the plain all-reduce after backward (parallel.grads.all_reduce_gradients;
the timed steps overlap it with backward), the plain AdamW over all parameters; the distributed optimizer's
reduce_gradients, AdamW over the slice, gather_params and zero_grad; and, on the distributed optimizer's buffers, the
collectives by themselves: an all-reduce of the gradient buffer, the reduce_scatter_tensor and the (cloned)
all_gather_into_tensor that the distributed optimizer uses off gloo.

With --overlap-blocks N, the same world then times the distributed optimizer with and without
parallel.overlap_param_gather (DistributedOptimizer(..., overlap_param_gather=True) and its forward pre-hooks,
`wait_in_forward`, as train/optimizer.py builds it): a third model, fresh from the same seed, runs blocks of
--overlap-block-steps consecutive steps, alternating block by block with the no-overlap "dist" model (AB BA ...);
each block ends with finish_param_gather() and a barrier, so the gathers still in flight count in their own block
and not in the other mode's. Consecutive steps, because the overlap hides the gathers behind the next forward of the
same model. The overlap model's losses are checked against the dist model's first steps (same weights, same batch).

    python benchmarks/dist_optim_cpu.py --steps 12
    python benchmarks/dist_optim_cpu.py --dp 2 --steps 4 --part-reps 0 --overlap-blocks 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MODES = ("plain", "dist")
BYTES_GOAL = 0.05
"""Dist moments per rank may exceed 1/DP of the plain run's by this fraction."""
TIME_GOAL = 1.1
"""Dist step time at most this multiple of the plain run's."""
PARTS = ("plain: all_reduce_gradients after backward", "plain: AdamW", "dist: reduce_gradients",
         "dist: AdamW on the slice", "dist: gather_params", "dist: zero_grad", "raw: all_reduce of the gradient buffer",
         "raw: reduce_scatter_tensor of the gradient buffer", "raw: all_gather_into_tensor of the slice (cloned)")
"""What _time_parts times; the raw ones are the collectives by themselves on the distributed optimizer's buffers."""
OVERLAP_MODES = ("dist", "dist_overlap")
"""The no-overlap distributed optimizer and the one with parallel.overlap_param_gather (--overlap-blocks)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int


@dataclass(frozen=True, slots=True)
class StateBytes:
    moments: int
    """Bytes of exp_avg and exp_avg_sq."""
    steps: int
    """Bytes of the scalar step counters."""


@dataclass(frozen=True, slots=True)
class Row:
    """One DP size's figures."""

    dp: int
    params: int
    plain_bytes: int
    dist_bytes: int
    """The largest of the ranks' moment bytes (the last rank's slice holds the padding, so it owns the fewest)."""
    plain_s: float
    dist_s: float
    plain_best_s: float
    dist_best_s: float
    paired: float
    """Median over steps of dist / plain for the two steps of the same iteration, which ran back to back: the
    figure least moved by load that comes and goes over seconds."""

    @property
    def bytes_ratio(self) -> float:
        return self.dist_bytes / self.plain_bytes

    @property
    def bytes_ok(self) -> bool:
        return self.bytes_ratio <= (1.0 + BYTES_GOAL) / self.dp

    @property
    def time_ratio(self) -> float:
        return self.dist_s / self.plain_s

    @property
    def time_ok(self) -> bool:
        return self.time_ratio <= TIME_GOAL


def mode_order(step: int) -> tuple[str, ...]:
    """Which mode runs first at `step`: they swap every step (AB BA AB ...), so neither always follows the other."""
    return MODES if step % 2 == 0 else MODES[::-1]


def state_bytes(state: Mapping[Any, Mapping[str, Any]]) -> StateBytes:
    """Bytes of an optimizer's state (its .state mapping): Adam's moments and, apart, the step counters."""
    moments = steps = 0
    for entry in state.values():
        for key, value in entry.items():
            if not hasattr(value, "numel"):
                continue
            size = value.numel() * value.element_size()
            if key == "step":
                steps += size
            else:
                moments += size
    return StateBytes(moments=moments, steps=steps)


def table(rows: list[Row]) -> str:
    """Markdown table of the figures and their ratios against the goals."""
    lines = ["| DP | params | Adam moments per rank: plain | dist (max rank) | dist / plain | 1/DP | bytes goal | "
             "step: plain median (best) | dist median (best) | dist / plain: medians (best steps) | paired | "
             "time goal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r.dp} | {r.params / 1e6:.1f}M | {r.plain_bytes / 2**20:.1f} MiB | {r.dist_bytes / 2**20:.1f} MiB | "
            f"{r.bytes_ratio:.4f} | {1 / r.dp:.4f} | {'met' if r.bytes_ok else 'missed'} | "
            f"{_ms(r.plain_s, r.plain_best_s)} | {_ms(r.dist_s, r.dist_best_s)} | "
            f"{r.time_ratio:.3f} ({r.dist_best_s / r.plain_best_s:.3f}) | {r.paired:.3f} | "
            f"{'met' if r.time_ok else 'missed'} |")
    return "\n".join(lines)


def _ms(median: float, best: float) -> str:
    return f"{median * 1000:.0f} ({best * 1000:.0f}) ms"


def overlap_row(dp: int, overlap: dict[str, Any]) -> dict[str, float]:
    """Medians of the blocks' seconds per step, the median of the paired (same round) ratios, the loss check."""
    times = overlap["times"]
    paired = statistics.median(o / d for d, o in zip(times["dist"], times["dist_overlap"], strict=True))
    return {"dp": dp, "dist_s": statistics.median(times["dist"]), "overlap_s": statistics.median(times["dist_overlap"]),
            "paired": paired, "loss_diff": overlap["loss_diff"], "steps": overlap["compared_steps"]}


def overlap_table(rows: list[dict[str, float]]) -> str:
    lines = ["| DP | dist: step median | dist + overlap_param_gather | overlap / dist: medians | paired | "
             "loss vs dist (steps) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['dp']} | {r['dist_s'] * 1000:.0f} ms | {r['overlap_s'] * 1000:.0f} ms | "
                     f"{r['overlap_s'] / r['dist_s']:.3f} | {r['paired']:.3f} | {r['loss_diff']:.1e} "
                     f"({r['steps']}) |")
    return "\n".join(lines)


def row_from(dp: int, results: list[dict[str, Any]]) -> Row:
    """A Row from the ranks' JSON results (rank 0 holds the times)."""
    times = results[0]["times"]
    paired = statistics.median(d / p for p, d in zip(times["plain"], times["dist"], strict=True))
    return Row(dp=dp, params=results[0]["params"], paired=paired,
               plain_bytes=max(r["bytes"]["plain"]["moments"] for r in results),
               dist_bytes=max(r["bytes"]["dist"]["moments"] for r in results),
               plain_s=statistics.median(times["plain"]), dist_s=statistics.median(times["dist"]),
               plain_best_s=min(times["plain"]), dist_best_s=min(times["dist"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    parser.add_argument("--part-reps", type=int, default=5, help="timed repetitions of each part (0: skip)")
    parser.add_argument("--overlap-blocks", type=int, default=0,
                        help="timed blocks per mode of dist with and without overlap_param_gather (0: skip)")
    parser.add_argument("--overlap-block-steps", type=int, default=3, help="consecutive steps per block")
    args = parser.parse_args(argv)
    if min(args.dp) < 2:
        parser.error(f"--dp {args.dp}: every DP size must be at least 2 (DP=1 has nothing to shard)")
    return args


# -- the worlds ---------------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, rendezvous: str, shape: ModelShape, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_hpc.config.schema import ModelConfig, OptimConfig
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.parallel.device import keep_freed_memory
    from megatron_hpc.plan.mesh import Mesh
    from megatron_hpc.plan.vocab import padded_vocab_size
    from megatron_hpc.train.distributed_optimizer import DistributedOptimizer
    from megatron_hpc.train.loop import build_model
    from megatron_hpc.train.optim import PlainOptimizer
    from megatron_hpc.train.step import MicroBatches, train_step

    keep_freed_memory()  # the trainer's CPU setup (train/entry.py)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world), rank=rank)
        cfg = ModelConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                          seq_length=shape.seq, max_position_embeddings=shape.seq, vocab_size=shape.vocab)
        padded = padded_vocab_size(cfg.vocab_size, divisible_by=cfg.make_vocab_size_divisible_by, tensor_parallel=1)
        optim = OptimConfig(lr=1e-4)
        models = {m: build_model(cfg, ctx, padded_vocab=padded, seed=1234, device=torch.device("cpu"))
                  for m in MODES}
        # As train/optimizer.py builds them with the default parallel config (overlap on, 128 MiB buckets).
        optimizers = {"plain": PlainOptimizer(models["plain"], optim=optim, ctx=ctx, device_kind="cpu", overlap=True,
                                              bucket_mb=128.0),
                      "dist": DistributedOptimizer(models["dist"], optim=optim, ctx=ctx, overlap=True,
                                                   bucket_mb=128.0)}
        steps = {m: MicroBatches(models[m], ctx=ctx, autocast_dtype=None, device_type="cpu") for m in MODES}
        gen = torch.Generator().manual_seed(1000 + rank)  # each DP rank its own batch, the same for both modes
        batch = [torch.randint(0, cfg.vocab_size, (shape.micro_batch, shape.seq + 1), generator=gen)]
        times: dict[str, list[float]] = {m: [] for m in MODES}
        losses: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.warmup + args.steps):
            for mode in mode_order(i):
                dist.barrier()
                start = time.perf_counter()
                result = train_step(steps[mode], optimizers[mode], batch)
                dist.barrier()
                if i >= args.warmup:
                    times[mode].append(time.perf_counter() - start)
                losses[mode].append(float(result.loss))
        record = {
            "params": sum(p.numel() for p in models["plain"].parameters()),
            "bytes": {"plain": asdict(state_bytes(optimizers["plain"].optimizer.state)),
                      "dist": asdict(state_bytes(optimizers["dist"].optimizer.state))},
            "times": times, "losses": losses,
            "parts": _time_parts(models, optimizers, ctx, reps=args.part_reps) if args.part_reps else {},
        }
        if args.overlap_blocks:
            del models["plain"], optimizers["plain"], steps["plain"]  # memory for the third model
            record["overlap"] = _time_overlap(models["dist"], optimizers["dist"], cfg, padded, optim, ctx, batch,
                                              args=args, dist_losses=losses["dist"])
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def _time_overlap(dist_model: Any, dist_opt: Any, cfg: Any, padded: int, optim: Any, ctx: Any, batch: list,
                  *, args: argparse.Namespace, dist_losses: list[float]) -> dict[str, Any]:
    """Seconds per step of blocks of consecutive steps, dist and dist_overlap alternating block by block; and the
    overlap model's largest relative loss difference from the dist model's first steps."""
    import torch
    import torch.distributed as dist

    from megatron_hpc.train.distributed_optimizer import DistributedOptimizer
    from megatron_hpc.train.loop import build_model
    from megatron_hpc.train.step import MicroBatches, train_step

    model = build_model(cfg, ctx, padded_vocab=padded, seed=1234, device=torch.device("cpu"))
    overlapped = DistributedOptimizer(model, optim=optim, ctx=ctx, overlap=True, bucket_mb=128.0,
                                      overlap_param_gather=True)
    overlapped.wait_in_forward(model)
    runs = {mode: (MicroBatches(m, ctx=ctx, autocast_dtype=None, device_type="cpu"), opt)
            for mode, (m, opt) in {"dist": (dist_model, dist_opt), "dist_overlap": (model, overlapped)}.items()}
    times: dict[str, list[float]] = {m: [] for m in OVERLAP_MODES}
    losses: list[float] = []
    n = args.overlap_block_steps
    for block in range(1 + args.overlap_blocks):  # the first block of each mode warms up
        for mode in (OVERLAP_MODES if block % 2 == 0 else OVERLAP_MODES[::-1]):
            m, opt = runs[mode]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                result = train_step(m, opt, batch)
                if mode == "dist_overlap":
                    losses.append(float(result.loss))  # host read of the loss: the trainer's log line does one too
            opt.finish_param_gather()
            dist.barrier()
            if block:
                times[mode].append((time.perf_counter() - start) / n)
    k = min(len(losses), len(dist_losses))
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses[:k], dist_losses[:k]))
    return {"times": times, "loss_diff": diff, "compared_steps": k}


def _time_parts(models: dict, optimizers: dict, ctx: Any, *, reps: int) -> dict[str, list[float]]:
    """Each part in which the modes differ, barrier-framed, alternated as the steps are; then, for comparison, the
    collectives the distributed optimizer uses on NCCL, run here on gloo. They act on the last step's gradients
    and change weights and moments: run after the timed steps only."""
    import torch
    import torch.distributed as dist

    from megatron_hpc.parallel.grads import all_reduce_gradients

    plain, dist_opt = optimizers["plain"], optimizers["dist"]
    plain_params = [p for p in models["plain"].parameters() if p.requires_grad]
    group = ctx.dp_group
    first = dist_opt.layout.buckets[0]  # the raw collectives on the first bucket (the whole buffer up to 128 MiB)
    lo, hi = dist_opt.layout.slice_of(first)
    buffer = dist_opt.grad_buffer[first.start:first.start + first.padded]
    shard = dist_opt.param_buffer[lo:hi]
    scratch = torch.empty_like(shard)

    def all_gather() -> None:
        dist.all_gather_into_tensor(dist_opt.param_buffer[first.start:first.start + first.padded], shard.clone(),
                                    group=group)

    parts = {PARTS[0]: lambda: all_reduce_gradients(plain_params, group=group, bucket_mb=128.0),
             PARTS[1]: plain.optimizer.step,
             PARTS[2]: dist_opt.reduce_gradients,
             PARTS[3]: dist_opt.optimizer.step,
             PARTS[4]: dist_opt.gather_params,
             PARTS[5]: dist_opt.zero_grad,
             PARTS[6]: lambda: dist.all_reduce(buffer, group=group),
             PARTS[7]: lambda: dist.reduce_scatter_tensor(scratch, buffer, group=group),
             PARTS[8]: all_gather}
    times: dict[str, list[float]] = {name: [] for name in PARTS}
    with torch.no_grad():
        for i in range(reps):
            for name in (PARTS if i % 2 == 0 else PARTS[::-1]):
                dist.barrier()
                start = time.perf_counter()
                parts[name]()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
    return times


def measure(dp: int, shape: ModelShape, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Every rank's JSON record of one DP world."""
    import torch.multiprocessing as mp
    from rendezvous import file_rendezvous

    out = tmp / f"dp{dp}"
    out.mkdir()
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the children's OpenMP at start
    mp.start_processes(_worker, args=(dp, file_rendezvous(out, "world"), shape, args, str(out)), nprocs=dp, join=True,
                       start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                       micro_batch=args.micro_batch)
    print(f"model: {asdict(shape)}, fp32, 1 thread per process on {os.cpu_count()} cores; median of {args.steps} "
          f"steps (+{args.warmup} warm-up) per mode, modes alternating", flush=True)
    rows, overlap_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.dp:
            started = time.time()
            results = measure(dp, shape, args, Path(tmp))
            rows.append(row_from(dp, results))
            losses = results[0]["losses"]
            diff = max(abs(a - b) / abs(a) for a, b in zip(losses["plain"], losses["dist"]))
            print(f"DP={dp}: {time.time() - started:.0f} s wall, load average {os.getloadavg()[0]:.2f}; "
                  f"rank 0 loss plain vs dist, largest relative difference {diff:.1e}", flush=True)
            for mode in MODES:
                steps_ms = " ".join(f"{t * 1000:.0f}" for t in results[0]["times"][mode])
                moments = " ".join(f"{r['bytes'][mode]['moments'] / 2**20:.2f}" for r in results)
                counters = " ".join(str(r["bytes"][mode]["steps"]) for r in results)
                print(f"  {mode} ms/step: {steps_ms}; moments per rank (MiB): {moments}; step counters per rank "
                      f"(B): {counters}", flush=True)
            for name, t in results[0]["parts"].items():
                print(f"  part {name}: median {statistics.median(t) * 1000:.0f} ms "
                      f"(best {min(t) * 1000:.0f})", flush=True)
            if "overlap" in results[0]:
                overlap_rows.append(overlap_row(dp, results[0]["overlap"]))
                for mode in OVERLAP_MODES:
                    per_step = " ".join(f"{t * 1000:.0f}" for t in results[0]["overlap"]["times"][mode])
                    print(f"  {mode} ms/step per block: {per_step}", flush=True)
    print(table(rows))
    if overlap_rows:
        print(overlap_table(overlap_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
