"""Activation bytes one micro-batch leaves for backward: plain, selective recomputation, TP 2 without and with
sequence parallelism, and SP with selective recomputation, measured with saved-tensor hooks
(megatron_hpc.model.saved_activations) on real gloo processes, next to megatron-hpc's estimate (plan/memory.py) and
Korthikanti et al. 2022's formulas.

The paper counts 16-bit activations with 1-byte dropout masks; this runs fp32 on the CPU, whose dropout keeps its
mask in fp32 too. So the paper's column is its formula with every term at 4 bytes: per layer
s*b*h*(10 + 24/t + 5*a*s/(h*t)) * 2 (plain), s*b*h*(10 + 24/t) * 2 (selective), s*b*h/t*(34 + 5*a*s/h) * 2 (SP),
34*s*b*h/t * 2 (both), times the layers; the measured figures also hold what sits outside the layers (the
embedding's dropout mask, the final norm's and output layer's inputs), which the estimate counts and the paper
leaves out. Rank 0's figures are printed (TP ranks hold the same).

    python benchmarks/activation_bytes.py --layers 8 --hidden 256 --heads 8 --seq 512 --batch 2
    python benchmarks/activation_bytes.py --layers 1 --hidden 32 --heads 2 --seq 16 --batch 1 --vocab 64 \
        --modes plain sp_tp2_selective     # smoke test (the suite runs it): the script, not the figure
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MODES = {
    "plain": (1, False, None),
    "selective": (1, False, "selective"),
    "tp2": (2, False, None),
    "sp_tp2": (2, True, None),
    "sp_tp2_selective": (2, True, "selective"),
}
"""name -> (tensor parallel, sequence parallel, recompute granularity)"""


def paper_bytes(mode: str, *, layers: int, s: int, b: int, h: int, a: int, value: int = 4) -> float:
    """Korthikanti et al.'s per-layer count (eqs. 1, 2, 4, 6) times the layers, every element `value` bytes (their
    16-bit formula has 2 per element, so it is scaled by value / 2; their masks are 1 byte, counted here as 2
    before the scaling, which is what an fp32 CPU mask weighs)."""
    t, sp, recompute = MODES[mode]
    core = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    per_layer = s * b * h * ((34 / t) + core) if sp else s * b * h * (10 + 24 / t + core)
    masks = 2 * s * b * h / (t if sp else 1)  # the two 1-byte masks, raised to 2 bytes before the scaling
    return layers * (per_layer + masks) * value / 2


def table(rows: list[dict]) -> str:
    """Markdown table of the measured figures against the estimate and the paper, with the ratios."""
    base = next(r for r in rows if r["mode"] == "plain")["measured"]
    lines = ["| mode | measured MiB | / plain | estimate MiB | measured / estimate | paper (layers) MiB | "
             "measured / paper |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        mib = 1024 * 1024
        lines.append(f"| {r['mode']} | {r['measured'] / mib:.2f} | {r['measured'] / base:.3f} | "
                     f"{r['estimate'] / mib:.2f} | {r['measured'] / r['estimate']:.3f} | {r['paper'] / mib:.2f} | "
                     f"{r['measured'] / r['paper']:.3f} |")
    return "\n".join(lines)


def _worker(rank: int, world: int, rendezvous: str, mode: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_hpc.config.schema import ModelConfig
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.model.saved_activations import saved_activation_bytes
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.memory import GIB, estimate_memory
    from megatron_hpc.plan.mesh import Mesh
    from megatron_hpc.plan.vocab import padded_vocab_size

    torch.set_num_threads(1)
    _, sp, recompute = MODES[mode]
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=world), rank=rank)
        cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                          seq_length=args.seq, max_position_embeddings=args.seq, vocab_size=args.vocab,
                          hidden_dropout=0.1, attention_dropout=0.1, recompute_granularity=recompute)
        padded = padded_vocab_size(cfg.vocab_size, divisible_by=cfg.make_vocab_size_divisible_by,
                                   tensor_parallel=world)
        model = GPT(cfg, ctx=ctx, padded_vocab=padded, seed=1234, sequence_parallel=sp)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        measured = saved_activation_bytes(model, [ids])
        est = estimate_memory(cfg, padded_vocab=padded, tensor_parallel=world, micro_batch=args.batch,
                              precision="fp32", backend="gloo", sequence_parallel=sp)
        if rank == 0:
            row = {"mode": mode, "measured": measured, "estimate": est.micro_batch_activations_gib * GIB,
                   "paper": paper_bytes(mode, layers=args.layers, s=args.seq, b=args.batch, h=args.hidden,
                                        a=args.heads)}
            Path(out).write_text(repr(row))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--out", default="/tmp/activation_bytes")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="the rows to measure (plain, which the others are divided by, always runs)")
    args = parser.parse_args(argv)

    import ast

    import torch.multiprocessing as mp
    from rendezvous import file_rendezvous

    rows = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for mode, (tp, _, _) in MODES.items():
        if mode != "plain" and mode not in args.modes:
            continue
        out = str(Path(args.out) / f"{mode}.txt")
        mp.start_processes(_worker, args=(tp, file_rendezvous(args.out, mode), mode, args, out), nprocs=tp,
                           join=True, start_method="spawn")
        rows.append(ast.literal_eval(Path(out).read_text()))
    print(f"layers {args.layers}, h {args.hidden}, heads {args.heads}, s {args.seq}, b {args.batch}, fp32, "
          "dropout 0.1 (CPU: fp32 masks, math attention)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
