"""Issue 28: what heartbeats and straggler timing cost a training step. Goal: < 1% of the step.

One world of 2 real processes over gloo (1 thread each) builds the trainer's GPT once and runs megatron_hpc's
train_step on it in two modes, alternating step by step (off, on, on, off, off, on, ...) so the shared machine's
load hits both alike:

- off: train_step with the plain forward-backward (no heartbeat, no timing, no gather);
- on: as train/loop.py runs it: Pulse.step_begins, the forward-backward wrapped by Pulse.timed, Pulse.step_ends,
  heartbeats written to a run folder (three pwrites per step), and every --log-interval steps of this mode a log
  step, where the Stragglers gather (one all-reduce of a (world, 4) table) and, on the last rank, the decision and
  stragglers.json run when due: once the steps since the last gather took GATHER_COST_BOUND x its cost.

Every step is barrier-framed; rank 0's step times are reported: the medians and the median of the paired
differences (each on step against the off step next to it). The side-by-side difference is at the noise floor on a
shared machine, so the same world also times the added work by itself, many times: the pulse's calls of one step
(beats and clock reads), the gather's all-reduce and the last rank's decision; the pulse plus the gathers that ran
(their number over the on steps) per step, over the median off step, is the overhead figure the goal is checked on.

    python benchmarks/heartbeat_overhead.py --steps 60
    python benchmarks/heartbeat_overhead.py --steps 2 --warmup 0 --layers 1 --hidden 32 --heads 2 --seq 16 \
        --vocab 64 --reps 10     # smoke test (the suite runs it): the script, not the figure
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL = 0.01
"""Heartbeats and straggler timing may add at most this fraction to a step."""


def mode_order(step: int) -> tuple[str, str]:
    return ("off", "on") if step % 2 == 0 else ("on", "off")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    parser.add_argument("--log-interval", type=int, default=10, help="steps of the on mode between two log steps "
                        "(a gather runs at a log step when due)")
    parser.add_argument("--reps", type=int, default=2000, help="repetitions of the added work timed by itself")
    return parser.parse_args(argv)


def _worker(rank: int, world: int, rendezvous: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_hpc.config.schema import ModelConfig, OptimConfig
    from megatron_hpc.heartbeat import HeartbeatWriter
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.parallel.device import DeviceInfo, keep_freed_memory, resolve_device
    from megatron_hpc.plan.mesh import Mesh
    from megatron_hpc.plan.vocab import padded_vocab_size
    from megatron_hpc.train.loop import build_model
    from megatron_hpc.train.optim import PlainOptimizer
    from megatron_hpc.train.pulse import Pulse
    from megatron_hpc.train.step import MicroBatches, train_step
    from megatron_hpc.train.stragglers import KnobsForTests, RankNodes, Stragglers

    keep_freed_memory()  # the trainer's CPU setup (train/entry.py)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world), rank=rank)
        device: DeviceInfo = resolve_device("gloo", local_rank=rank)
        cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                          seq_length=args.seq, max_position_embeddings=args.seq, vocab_size=args.vocab)
        padded = padded_vocab_size(cfg.vocab_size, divisible_by=cfg.make_vocab_size_divisible_by, tensor_parallel=1)
        model = build_model(cfg, ctx, padded_vocab=padded, seed=1234, device=torch.device("cpu"))
        optimizer = PlainOptimizer(model, optim=OptimConfig(lr=1e-4), ctx=ctx, device_kind="cpu", overlap=True,
                                   bucket_mb=128.0)
        run_dir = Path(out) / "run"
        pulse = Pulse(HeartbeatWriter(run_dir, rank, host=socket.gethostname()), rank=rank, device=device.device,
                      hang_timeout_s=None)
        nodes = RankNodes.of(rank=rank, world_size=world, workers_per_node=world, knobs=KnobsForTests())
        stragglers = Stragglers(pulse, nodes, device=device, threshold=1.2, run_dir=run_dir,
                                enabled=rank == world - 1, out=open(os.devnull, "w"))  # noqa: SIM115
        plain = MicroBatches(model, ctx=ctx, autocast_dtype=None, device_type="cpu")
        fb = {"off": plain, "on": pulse.timed(plain)}
        gen = torch.Generator().manual_seed(1000 + rank)
        batch = [torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq + 1), generator=gen)]
        times: dict[str, list[float]] = {"off": [], "on": []}
        on_steps, gathers = 0, 0
        for i in range(args.warmup + args.steps):
            for mode in mode_order(i):
                dist.barrier()
                start = time.perf_counter()
                if mode == "on":
                    on_steps += 1
                    pulse.step_begins(on_steps)
                train_step(fb[mode], optimizer, batch)
                if mode == "on":
                    pulse.step_ends()
                    if on_steps % args.log_interval == 0:
                        pulse.beat("log", on_steps)
                        stragglers.at_log(on_steps)
                        gathers += stragglers.last_gather == on_steps
                dist.barrier()
                if i >= args.warmup:
                    times[mode].append(time.perf_counter() - start)
        record = {"times": times, "parts": _time_parts(pulse, stragglers, reps=args.reps), "gathers": gathers,
                  "on_steps": on_steps, "every_steps": stragglers.every_steps}
        record["stragglers_json"] = (run_dir / "stragglers.json").is_file()
        pulse.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def _time_parts(pulse: Any, stragglers: Any, *, reps: int) -> dict[str, float]:
    """Seconds per repetition of the added work, each part by itself: one step's pulse calls (beats, clock reads,
    the section bookkeeping), the gather's all-reduce of the (world, 4) table (barrier-framed, so that one rank's late
    arrival is not counted), and the last rank's decision with its stragglers.json (0 on the other ranks)."""
    import torch
    import torch.distributed as dist

    pulse.starts_at(0)
    start = time.perf_counter()
    for i in range(1, reps + 1):
        pulse.step_begins(i)
        pulse.compute_done()
        pulse.step_ends()
        if i % 100 == 0:
            pulse.interval()  # what a log reads, so the section list stays as short as in a run
    per_step = (time.perf_counter() - start) / reps
    pulse.interval()
    table = torch.ones(len(stragglers.nodes.node_of), 4)
    gathers, reduce_s = max(1, reps // 100), 0.0
    for _ in range(gathers):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
        reduce_s += time.perf_counter() - start
    start = time.perf_counter()
    if stragglers.enabled:
        for i in range(gathers):
            stragglers._decide(i, torch.ones(len(stragglers.nodes.node_of), 4).tolist())
    decide_s = time.perf_counter() - start
    return {"pulse per step": per_step, "all-reduce per log": reduce_s / gathers,
            "decision per log": decide_s / gathers}


def summary(records: list[dict[str, Any]], *, log_interval: int) -> tuple[str, float]:
    """The result lines and the overhead fraction the goal is checked on (rank 0's step times; the last rank's
    decision)."""
    times, parts = records[0]["times"], records[0]["parts"]
    decide = records[-1]["parts"]["decision per log"]
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    paired = statistics.median(b - a for a, b in zip(times["off"], times["on"]))
    per_log = parts["all-reduce per log"] + decide
    gathers, on_steps = records[0]["gathers"], records[0]["on_steps"]
    overhead = (parts["pulse per step"] + per_log * gathers / on_steps) / off
    lines = [f"step (rank 0, median of {len(times['off'])}): off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms "
             f"(best {min(times['off']) * 1e3:.2f} / {min(times['on']) * 1e3:.2f}); side by side on - off: median "
             f"{(on - off) / off * 100:+.2f}%, paired median {paired / off * 100:+.2f}%",
             f"added work by itself: pulse {parts['pulse per step'] * 1e6:.1f} us/step; per gather: all-reduce "
             f"{parts['all-reduce per log'] * 1e3:.3f} ms, last rank's decision {decide * 1e3:.3f} ms",
             f"gathers: {gathers} in {on_steps} on steps (log every {log_interval}; the last agreed spacing "
             f"{records[0]['every_steps']} steps)",
             f"overhead = (pulse + per gather x {gathers}/{on_steps}) / off step = {overhead * 100:.3f}%; goal < "
             f"{GOAL * 100:.0f}% -> {'met' if overhead < GOAL else 'NOT met'}"]
    return "\n".join(lines), overhead


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp
    from rendezvous import file_rendezvous

    args = parse_args(argv)
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, vocab {args.vocab}, "
          f"micro-batch {args.micro_batch}, fp32; 2 ranks gloo, 1 thread each, on {os.cpu_count()} cores; "
          f"{args.steps} timed steps per mode (+{args.warmup}), alternating; log every {args.log_interval}",
          flush=True)
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the children's OpenMP at start
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(2, file_rendezvous(tmp, "world"), args, tmp), nprocs=2, join=True,
                           start_method="spawn")
        records = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    assert records[1]["stragglers_json"], "the last rank wrote no stragglers.json"
    text, _ = summary(records, log_interval=args.log_interval)
    print(f"{time.time() - started:.0f} s wall, load average {os.getloadavg()[0]:.2f}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
