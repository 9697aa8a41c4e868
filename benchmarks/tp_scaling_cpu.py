"""Step time of TP=2 relative to TP=1 for the same GPT on the CPU, with real processes over gloo.

TP=1 is one process with T threads; TP=2 is two processes with T/2 threads each, so both use the
same cores. Each world runs megatron_hpc's train_step (fp32) on the same global batch; rank 0
reports the median step time. The ratio is reported, not asserted: on a CPU the all-reduces of
TP usually cost more than the halved matmuls save.

    python benchmarks/tp_scaling_cpu.py --threads 2 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def _worker(rank: int, world: int, rendezvous: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_hpc.config.schema import ModelConfig, OptimConfig
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh
    from megatron_hpc.plan.vocab import padded_vocab_size
    from megatron_hpc.train.optim import PlainOptimizer
    from megatron_hpc.train.step import MicroBatches, train_step

    torch.set_num_threads(max(1, args.threads // world))
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=world), rank=rank)
        cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                          seq_length=args.seq, max_position_embeddings=args.seq, vocab_size=args.vocab)
        padded = padded_vocab_size(cfg.vocab_size, divisible_by=cfg.make_vocab_size_divisible_by,
                                   tensor_parallel=world)
        model = GPT(cfg, ctx=ctx, padded_vocab=padded, seed=1234)
        optimizer = PlainOptimizer(model, optim=OptimConfig(lr=1e-4), ctx=ctx, device_kind="cpu")
        forward_backward = MicroBatches(model, ctx=ctx, autocast_dtype=None, device_type="cpu")
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1),
                               generator=torch.Generator().manual_seed(0))
        times = []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            start = time.perf_counter()
            train_step(forward_backward, optimizer, [tokens])
            dist.barrier()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(str(statistics.median(times)))
    finally:
        dist.destroy_process_group()


def step_time(world: int, args: argparse.Namespace, tmp: Path) -> float:
    import torch.multiprocessing as mp
    from rendezvous import file_rendezvous

    out = tmp / f"tp{world}.txt"
    os.environ["OMP_NUM_THREADS"] = str(max(1, args.threads // world))
    mp.start_processes(_worker, args=(world, file_rendezvous(tmp, f"tp{world}"), args, str(out)), nprocs=world,
                       join=True, start_method="spawn")
    return float(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores shared by the ranks")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        t1 = step_time(1, args, Path(tmp))
        t2 = step_time(2, args, Path(tmp))
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, vocab "
          f"{args.vocab}, batch {args.batch}, fp32; {args.threads} cores; median of {args.steps} steps "
          f"(+{args.warmup} warm-up)")
    print(f"TP=1 (1 process x {args.threads} threads): {t1 * 1000:.1f} ms/step")
    print(f"TP=2 (2 processes x {max(1, args.threads // 2)} threads): {t2 * 1000:.1f} ms/step")
    print(f"ratio TP=2 / TP=1 step time: {t2 / t1:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
