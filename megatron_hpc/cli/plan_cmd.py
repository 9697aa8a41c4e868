"""`megatron-hpc plan`: check a recipe against a cluster and print what would run."""

from __future__ import annotations

import argparse
import json

from megatron_hpc.cli.common import add_recipe_arguments, resolve
from megatron_hpc.plan.planner import Plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)


def _count(n: float) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def format_plan(plan: Plan, *, vocab_size: int) -> str:
    workers = "worker" if plan.workers_per_node == 1 else "workers"
    rows = [
        ("recipe", f"{plan.recipe} on {plan.num_nodes} x {plan.platform} "
                   f"({plan.workers_per_node} {workers} per node, backend {plan.backend})"),
        ("mesh", f"world {plan.world_size} = TP {plan.tensor_parallel} x DP {plan.data_parallel}"),
        ("batch", f"global {plan.global_batch_size} = micro {plan.micro_batch_size} x DP {plan.data_parallel} "
                  f"x {plan.num_micro_batches} micro-batches; {plan.tokens_per_step:,} tokens per step"),
        ("model", f"{_count(plan.num_parameters)} parameters; padded vocab {plan.padded_vocab_size} "
                  f"({vocab_size} + {plan.padded_vocab_size - vocab_size} padding)"),
        ("memory", f"about {plan.memory_per_worker_gib:.1f} GiB of {plan.memory_limit_gib:g} GiB per worker"),
        ("flops", f"{plan.flops_per_token / 1e9:.2f} GFLOP per token ({plan.flops_formula}); "
                  f"6N gives {plan.flops_per_token_6n / 1e9:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    resolved = resolve(args)
    if args.json:
        print(json.dumps(resolved.plan.to_json(), indent=2))
    else:
        print(format_plan(resolved.plan, vocab_size=resolved.cfg.model.vocab_size))
    return 0
