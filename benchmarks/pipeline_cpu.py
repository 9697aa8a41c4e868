"""Pipeline efficiency on the CPU: PP=2 (1F1B and interleaved) against one process, next to the bubble formula's ideal.

Issue 14's figure. Every measurement is its own process world over gloo, running megatron_hpc's train_step (fp32,
the trainer's CPU allocator setting) on the same global batch of m micro-batches, in these cases:

- anchor: the whole model in one process with 2 threads, train_step without a pipeline;
- 1f1b: PP=2, two processes with 1 thread each (ParallelContext.build on Mesh(num_nodes=1, workers_per_node=2,
  pipeline_parallel=2), GPT(stages=...) and the real PipelineRunner passed to train_step), Schedule1F1B;
- interleaved: the same with virtual_pipeline=2 (each rank holds two chunks), ScheduleInterleaved1F1B;
- one-thread: the whole model in one process with 1 thread: the compute the ideal is made of.

The ideal PP=2 step. A stage holds 1/p of the layers, so with perfect balance and free transfers one stage's work
per step is t1 / p, t1 being the one-thread whole-model step (forward, backward, grad norm and AdamW over all
micro-batches; each stage also does 1/p of the norm and the update). 1F1B adds the bubble: the step is the
busy time over the busy share, ideal = (t1 / p) / (1 - bubble_fraction(p, m, v)), with plan/stages.py's
bubble_fraction (p - 1) / (m + p - 1), divided by v when interleaved. That equals Narayanan et al.'s
(m + p - 1) * t_stage for 1F1B (t_stage = t1 / (m p), one micro-batch's forward and backward on one stage); for
interleaving the paper's (m + (p - 1) / v) * t_stage is within 0.4% of it at p=2, v=2, m>=8. What the ideal does
not hold: the embedding and the loss sit on the first and last stage only (a small vocabulary keeps them small),
and the p2p sends, the tied embeddings' all-reduce and the schedule's bookkeeping, which are what measured/ideal
shows. Both sides of measured/ideal run 1 thread per process, so thread scaling does not enter it; it does enter
the ratio to the anchor (2 threads on one matmul rarely run 2x as fast as 1).

Size: 8 layers, hidden 384, seq 128, micro-batch 1, vocab 256. On the 2-core VM of RESULTS.md one micro-batch's
forward and backward of this model takes about 0.17 s on one thread (hidden 512, seq 256 took 0.64 s, 10 s a step
at m=16), while a stage boundary sends 192 KiB each way per micro-batch.

Order: in every round each micro-batch count runs its four cases back to back (A B C D, A B C D ...), so drift
of the shared machine hits all of them. Each case's figure is the median over rounds of its median step, and next
to it in brackets its best step over all rounds (as benchmarks/train_step_cpu.py does): other users take whole
cores away for seconds at a time, which a PP world, needing both cores at once, feels more than a one-thread one.
Every step is barrier-framed on all ranks; the first `--warmup` steps (the schedule's shape handshake, the
allocator settling) are not timed. OMP_NUM_THREADS and torch.set_num_threads are both set to each process's threads.

    python benchmarks/pipeline_cpu.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CORES = 2
"""Both sides use the same cores: 1 process x 2 threads against 2 processes x 1 thread."""


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    micro_batches: int
    pipeline: int = 1
    virtual: int = 1
    threads: int = CORES
    """Threads per process."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int


def cases(micro_batches: int) -> list[Case]:
    """The four measurements at one micro-batch count, in the order a round runs them."""
    return [Case("anchor", micro_batches),
            Case("1f1b", micro_batches, pipeline=2, threads=1),
            Case("interleaved", micro_batches, pipeline=2, virtual=2, threads=1),
            Case("one-thread", micro_batches, threads=1)]


def ideal_step(one_thread_s: float, *, pipeline: int, micro_batches: int, virtual: int) -> float:
    """The bubble formula's PP step time from the one-thread whole-model step (see the module docstring)."""
    from megatron_hpc.plan.stages import bubble_fraction

    bubble = bubble_fraction(pipeline=pipeline, micro_batches=micro_batches, virtual=virtual)
    return one_thread_s / pipeline / (1.0 - bubble)


def verdict(ratios: list[float]) -> str:
    """How paired per-round ratios (interleaved / 1F1B step time) read: all below 1, all above, or both."""
    if min(ratios) < 1.0 < max(ratios):
        return "not measurable (the rounds disagree on which is faster)"
    return "faster in every round" if max(ratios) < 1.0 else "slower in every round"


def _worker(rank: int, world: int, rendezvous: str, case: Case, shape: ModelShape, steps: tuple[int, int],
            out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_hpc.config.schema import ModelConfig, OptimConfig
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.parallel.device import keep_freed_memory
    from megatron_hpc.parallel.pipeline import PipelineRunner
    from megatron_hpc.plan.mesh import Mesh
    from megatron_hpc.plan.stages import rank_stages, stage_layouts
    from megatron_hpc.plan.vocab import padded_vocab_size
    from megatron_hpc.train.optim import PlainOptimizer
    from megatron_hpc.train.step import MicroBatches, PipelineSchedule, train_step

    keep_freed_memory()  # the trainer's CPU setup (train/entry.py)
    torch.set_num_threads(case.threads)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, pipeline_parallel=case.pipeline),
                                    rank=rank)
        cfg = ModelConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                          seq_length=shape.seq, max_position_embeddings=shape.seq, vocab_size=shape.vocab)
        padded = padded_vocab_size(cfg.vocab_size, divisible_by=cfg.make_vocab_size_divisible_by, tensor_parallel=1)
        stages = None
        if case.pipeline > 1:
            stages = rank_stages(stage_layouts(cfg.num_layers, pipeline=case.pipeline, virtual=case.virtual),
                                 ctx.pp_rank)
        model = GPT(cfg, ctx=ctx, padded_vocab=padded, seed=1234, stages=stages)
        optimizer = PlainOptimizer(model, optim=OptimConfig(lr=1e-4), ctx=ctx, device_kind="cpu")
        forward_backward = MicroBatches(model, ctx=ctx, autocast_dtype=None, device_type="cpu")
        if case.pipeline > 1:
            runner = PipelineRunner(model, ctx, num_micro_batches=case.micro_batches, schedule="1f1b",
                                    device=torch.device("cpu"))
            forward_backward = PipelineSchedule(runner, autocast_dtype=None, device_type="cpu")
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, cfg.vocab_size, (shape.micro_batch, shape.seq + 1), generator=gen)
                   for _ in range(case.micro_batches)]
        warmup, timed = steps
        times = []
        for i in range(warmup + timed):
            dist.barrier()
            start = time.perf_counter()
            train_step(forward_backward, optimizer, batches)
            dist.barrier()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def measure(case: Case, shape: ModelShape, *, steps: tuple[int, int], tmp: Path) -> list[float]:
    """Every timed step (s) of `case` in a fresh process world."""
    import torch.multiprocessing as mp

    out = tmp / f"{case.name}-{case.micro_batches}.json"
    out.unlink(missing_ok=True)
    from rendezvous import file_rendezvous

    rendezvous = file_rendezvous(tmp, f"{case.name}-{case.micro_batches}")
    os.environ["OMP_NUM_THREADS"] = str(case.threads)  # read by the children's OpenMP at start
    mp.start_processes(_worker, args=(case.pipeline, rendezvous, case, shape, steps, str(out)),
                       nprocs=case.pipeline, join=True, start_method="spawn")
    return json.loads(out.read_text())


@dataclass(frozen=True, slots=True)
class Summary:
    """One case's figures over all rounds."""

    median: float
    """Median over rounds of each round's median step."""
    best: float
    """Fastest single step of any round: the step least disturbed by the machine's other users."""
    per_round: list[float]


def summarize(rounds: list[list[float]]) -> Summary:
    per_round = [statistics.median(steps) for steps in rounds]
    return Summary(median=statistics.median(per_round), best=min(min(steps) for steps in rounds),
                   per_round=per_round)


def report(results: dict[tuple[str, int], list[list[float]]], micro_batch_counts: list[int]) -> None:
    """A row per PP case: measured, anchor, ratio, ideal, measured/ideal, for medians and best steps; then
    interleaved against 1F1B."""
    from megatron_hpc.plan.stages import bubble_fraction

    print("| case | m | bubble | step: median (best) | anchor | PP / anchor | ideal | measured / ideal |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in micro_batch_counts:
        anchor, one = summarize(results["anchor", m]), summarize(results["one-thread", m])
        for name, v in (("1f1b", 1), ("interleaved", 2)):
            t = summarize(results[name, m])
            ideal = [ideal_step(x, pipeline=2, micro_batches=m, virtual=v) for x in (one.median, one.best)]
            bubble = bubble_fraction(pipeline=2, micro_batches=m, virtual=v)
            print(f"| PP=2 {name} | {m} | {bubble:.1%} | {_ms(t.median, t.best)} | {_ms(anchor.median, anchor.best)} | "
                  f"{t.median / anchor.median:.2f} ({t.best / anchor.best:.2f}) | {_ms(*ideal)} | "
                  f"{t.median / ideal[0]:.2f} ({t.best / ideal[1]:.2f}) |")
        print(f"| one process, 1 thread | {m} | - | {_ms(one.median, one.best)} | {_ms(anchor.median, anchor.best)} | "
              f"{one.median / anchor.median:.2f} ({one.best / anchor.best:.2f}) | - | - |")
    for m in micro_batch_counts:
        inter, plain = summarize(results["interleaved", m]), summarize(results["1f1b", m])
        paired = [i / f for i, f in zip(inter.per_round, plain.per_round)]
        print(f"m={m}: interleaved / 1F1B round medians {', '.join(f'{x:.3f}' for x in paired)}: {verdict(paired)}; "
              f"best steps {inter.best / plain.best:.3f}")


def _ms(median: float, best: float) -> str:
    return f"{median * 1000:.0f} ({best * 1000:.0f}) ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256, help="small, so embedding and loss barely unbalance stages")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shape = ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                       micro_batch=args.micro_batch)
    print(f"model: {asdict(shape)}, fp32; {CORES} cores; median of {args.steps} steps (+{args.warmup} warm-up) "
          f"per world, median over {args.rounds} rounds", flush=True)
    results: dict[tuple[str, int], list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for m in args.micro_batches:
                for case in cases(m):
                    steps = measure(case, shape, steps=(args.warmup, args.steps), tmp=Path(tmp))
                    results.setdefault((case.name, m), []).append(steps)
                    print(f"round {r + 1} m={m} {case.name}: {' '.join(f'{t * 1000:.0f}' for t in steps)} ms/step "
                          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    report(results, args.micro_batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
