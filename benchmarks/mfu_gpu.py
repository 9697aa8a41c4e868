"""MFU of a ~1.3B GPT training step on one CUDA GPU (bf16 autocast), FLOPs from megatron_hpc's planner.

Model: 24 layers, hidden 2048, 16 heads, seq 2048, GPT-2 vocabulary padded to 50304, tied embeddings,
no dropout, no recomputation. One step = forward, backward, clip, AdamW through megatron_hpc's
train_step at TP=1. FLOPs per token: megatron_hpc.plan.model_math.flops_per_token (Megatron's classic
formula, shared/reference/megatron-and-launchers.md 4.4); the 6N figure is printed beside it.
MFU = FLOPs per token * tokens/s / peak (989 TFLOP/s dense bf16 for an H100 SXM by default).

    python benchmarks/mfu_gpu.py                       # on a machine with a CUDA GPU
    python benchmarks/mfu_gpu.py --micro-batch-size 8 --compile
    python benchmarks/mfu_gpu.py --allow-cpu --layers 2 --hidden 256 --heads 4 --seq 256 --vocab 1000 --steps 2  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

H100_BF16_PEAK_TFLOPS = 989.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_PEAK_TFLOPS)
    parser.add_argument("--compile", action="store_true", help="wrap the model in torch.compile")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when no GPU (smoke test only)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from megatron_hpc.config.schema import ModelConfig, OptimConfig
    from megatron_hpc.errors import TrainingError
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.parallel.device import resolve_device
    from megatron_hpc.plan.mesh import Mesh
    from megatron_hpc.plan.model_math import flops_per_token, flops_per_token_6n, num_parameters
    from megatron_hpc.plan.vocab import padded_vocab_size
    from megatron_hpc.train.optim import PlainOptimizer
    from megatron_hpc.train.step import MicroBatches, train_step

    try:
        device = resolve_device("nccl", local_rank=0)
    except TrainingError as exc:
        if not args.allow_cpu:
            print(f"mfu_gpu: no CUDA GPU here ({exc}); run it on a GPU machine "
                  f"(or pass --allow-cpu with a small model to smoke-test the script)", file=sys.stderr)
            return 2
        device = resolve_device("gloo", local_rank=0)
    store = dist.HashStore()  # a world of one needs no rendezvous
    dist.init_process_group(device.backend, store=store, rank=0, world_size=1)
    try:
        ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=1, tensor_parallel=1), rank=0,
                                    kind=device.kind)
        cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                          seq_length=args.seq, max_position_embeddings=args.seq, vocab_size=args.vocab)
        padded = padded_vocab_size(cfg.vocab_size, divisible_by=cfg.make_vocab_size_divisible_by, tensor_parallel=1)
        model = GPT(cfg, ctx=ctx, padded_vocab=padded, seed=1234).to(device.device)
        step_model = torch.compile(model) if args.compile else model
        optimizer = PlainOptimizer(model, optim=OptimConfig(lr=1e-4), ctx=ctx, device_kind=device.kind)
        forward_backward = MicroBatches(step_model, ctx=ctx, autocast_dtype=torch.bfloat16, device_type=device.kind)
        tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, args.seq + 1),
                               generator=torch.Generator().manual_seed(0)).to(device.device)
        def sync() -> None:
            if device.kind == "cuda":
                torch.accelerator.synchronize()  # the optimizer step is queued after train_step's host sync

        times = []
        for i in range(args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            train_step(forward_backward, optimizer, [tokens])
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        tokens_per_s = args.micro_batch_size * args.seq / step_s
        flops = flops_per_token(cfg, padded_vocab=padded)
        achieved = flops * tokens_per_s / 1e12
        print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, padded vocab "
              f"{padded}, {num_parameters(cfg, padded_vocab=padded) / 1e9:.2f}B parameters; micro batch "
              f"{args.micro_batch_size}, bf16 autocast, compile {args.compile}, device {device.kind}")
        print(f"step time median {step_s * 1000:.1f} ms over {args.steps} steps (+{args.warmup} warm-up); "
              f"{tokens_per_s:,.0f} tokens/s")
        six_n = flops_per_token_6n(cfg, padded_vocab=padded)
        print(f"FLOPs/token: megatron-classic {flops / 1e9:.2f} G, 6N {six_n / 1e9:.2f} G")
        print(f"achieved {achieved:.1f} TFLOP/s; MFU {100 * achieved / args.peak_tflops:.1f}% of "
              f"{args.peak_tflops:.0f} TFLOP/s")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
