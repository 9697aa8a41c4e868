"""`megatron-hpc plan`: check a recipe against a cluster and print what would run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from megatron_hpc.cli.common import Resolved, add_recipe_arguments, resolve

if TYPE_CHECKING:  # imported by run(): building the parser stays free of numpy (data) and of the planner
    from megatron_hpc.data.preflight import DataSummary
    from megatron_hpc.plan.planner import Plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
    parser.add_argument("--explain", action="store_true",
                        help="also list the next best layouts that fit, with their predicted step time and what "
                             "limits each")


def _count(n: float) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def data_summary(resolved: Resolved) -> DataSummary:
    """The data line's numbers for this plan (reads the .idx files when they are here)."""
    from megatron_hpc.data.preflight import summarize_data

    plan = resolved.plan
    return summarize_data(resolved.cfg.data, source=plan.data_source, seq_length=plan.seq_length,
                          num_samples=resolved.cfg.train.num_steps * plan.global_batch_size)


def _checkpoint_line(resolved: Resolved) -> str:
    ckpt, plan = resolved.cfg.checkpoint, resolved.plan
    when = (f"every {ckpt.save_interval} steps and at the end" if ckpt.save_interval
            else "only at the end (and on a stop signal): set checkpoint.save_interval to save along the way")
    return (f"{plan.checkpoint_gib:.1f} GiB each (fp32 weights + Adam moments), {when}; keeps the last "
            f"{ckpt.keep_last}")


def _lr_line(resolved: Resolved) -> str:
    optim, plan = resolved.cfg.optim, resolved.plan
    unit = plan.lr_schedule_unit
    return (f"{optim.lr:g} -> {optim.min_lr:g} {optim.lr_decay_style}, warmup {plan.lr_warmup:g} and decay over "
            f"{plan.lr_decay:,} {unit}")


_SCHEDULE_NAMES = {"1f1b": "1F1B", "afab": "all-forward-all-backward"}


def _pipeline_line(plan: Plan) -> str:
    p, v = plan.pipeline_parallel, plan.virtual_pipeline
    if p == 1:
        return "none (PP 1)"
    schedule = ("interleaved " if v > 1 else "") + _SCHEDULE_NAMES.get(plan.pipeline_schedule, plan.pipeline_schedule)
    counts = [stop - start for start, stop in plan.stage_layers]
    each = f"{counts[0]} layer{'s' if counts[0] > 1 else ''} each"
    layers = each if len(set(counts)) == 1 else f"layers {', '.join(map(str, counts))}"
    stages = f"{p} stages x {v} virtual" if v > 1 else f"{p} stages"
    return (f"{stages} ({layers}), {schedule} over {plan.num_micro_batches} micro-batches; bubble "
            f"{plan.bubble_fraction:.1%} of the step")


_TERM_NAMES = {"compute": "compute", "recompute": "recompute", "tp_comm": "TP comm", "pp_comm": "PP comm",
               "pipeline_bubble": "bubble", "dp_comm": "DP comm", "optimizer": "optimizer"}


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 0.01 else f"{value * 1e3:.3g} ms"


def _step_line(plan: Plan) -> str:
    on = _hardware_name(plan)
    parts = ", ".join(f"{_TERM_NAMES.get(k, k)} {_seconds(v)}" for k, v in plan.step_time_breakdown_s.items() if v)
    return (f"predicted {_seconds(plan.predicted_step_time_s)}: {_count(plan.predicted_tokens_per_s)} tokens/s, MFU "
            f"{plan.predicted_mfu:.1%} on {on}; {parts}; calibration: {plan.calibration}")


def explain_lines(plan: Plan) -> list[str]:
    """`plan --explain`: the next best layouts that fit, with their predicted time and what limits each."""
    if not plan.layout_alternatives:
        return ["next best layouts: none (no other layout fits, or the recipe pins TP and PP)"]
    lines = [f"next best layouts (chosen: TP {plan.tensor_parallel} x PP {plan.pipeline_parallel} x DP "
             f"{plan.data_parallel}, {_seconds(plan.predicted_step_time_s)}):"]
    for alt in plan.layout_alternatives:
        slower = alt["predicted_step_time_s"] / plan.predicted_step_time_s - 1
        lines.append(f"  TP {alt['tensor_parallel']} x PP {alt['pipeline_parallel']} x DP {alt['data_parallel']}: "
                     f"{_seconds(alt['predicted_step_time_s'])} ({slower:+.0%}), {alt['memory_per_worker_gib']:.1f} "
                     f"GiB per worker; limited by {alt['limit']}")
    return lines


_MEMORY_PARTS = {"weights": "weights", "grads": "grads", "optimizer": "Adam", "activations": "activations",
                 "logits": "logits"}


def _memory_line(plan: Plan) -> str:
    # Below 1 GiB (the CPU demos) tenths of a GiB would print every part as 0.0: those plans count in MiB.
    if plan.memory_per_worker_gib < 1:
        total = f"{plan.memory_per_worker_gib * 1024:.0f} MiB"
        parts = ", ".join(f"{_MEMORY_PARTS[k]} {v * 1024:.0f} MiB" for k, v in plan.memory_breakdown_gib.items())
    else:
        total = f"{plan.memory_per_worker_gib:.1f} GiB"
        parts = ", ".join(f"{_MEMORY_PARTS[k]} {v:.1f}" for k, v in plan.memory_breakdown_gib.items())
    where = f" (pipeline rank {plan.memory_pp_rank}, the heaviest)" if plan.pipeline_parallel > 1 else ""
    adam = "; Adam sharded over DP" if plan.distributed_optimizer else ""
    return (f"about {total} of {plan.memory_limit_gib:g} GiB per worker{where}: "
            f"{parts}; recompute {plan.recompute}{adam}")


def plan_warnings(resolved: Resolved) -> list[str]:
    """What `plan` says on stderr (and `plan --json` under "warnings") about a plan it prints: idle workers, the
    recipe's caveat, a runtime that cannot run it."""
    from megatron_hpc.plan.planner import distributed_optimizer_warning, idle_workers_warning, pipeline_runtime_warning

    idle = idle_workers_warning(resolved.plan)
    warnings = [idle] if idle else []
    warnings += [resolved.cfg.warning] if resolved.cfg.warning else []
    warnings += [resolved.calibration_note] if resolved.calibration_note else []
    runtime = pipeline_runtime_warning(resolved.plan, cfg=resolved.cfg)
    warnings += [runtime] if runtime else []
    pointless = distributed_optimizer_warning(resolved.plan)
    warnings += [pointless] if pointless else []
    if resolved.plan.pipeline_parallel == 1 and resolved.plan.pipeline_schedule != "1f1b":
        warnings.append(f"parallel.pipeline_schedule={resolved.plan.pipeline_schedule} is ignored: this plan has no "
                        "pipeline (PP 1)")
    if resolved.plan.data_source == "missing":
        warnings.append("no training data: `submit` refuses this plan; set --set data.path=PREFIX, or --set "
                        "data.source=synthetic to train on synthetic tokens on purpose")
    return warnings


def _hardware_name(plan: Plan) -> str:
    """The platform, or a platform file's hardware with the built-in it runs as."""
    return plan.platform if plan.hardware == plan.platform else f"{plan.hardware} (runs as {plan.platform})"


def format_plan(resolved: Resolved, *, data: DataSummary | None = None) -> str:
    from megatron_hpc.plan.architecture import describe

    plan = resolved.plan
    vocab_size = resolved.cfg.model.vocab_size
    architecture = describe(resolved.cfg.model)
    workers = "worker" if plan.workers_per_node == 1 else "workers"
    if plan.idle_workers_per_node:
        workers = f"of {plan.workers_per_node + plan.idle_workers_per_node} workers"
    rows = [
        ("recipe", f"{plan.recipe} on {plan.num_nodes} x {plan.hardware} ({plan.workers_per_node} {workers} per node, "
                   f"{'' if plan.hardware == plan.platform else f'runs as {plan.platform}, '}backend {plan.backend})"),
        ("mesh", f"world {plan.world_size} = TP {plan.tensor_parallel} x PP {plan.pipeline_parallel} x "
                 f"DP {plan.data_parallel}"),
        ("pipeline", _pipeline_line(plan)),
        ("batch", f"global {plan.global_batch_size} = micro {plan.micro_batch_size} x DP {plan.data_parallel} "
                  f"x {plan.num_micro_batches} micro-batches; {plan.tokens_per_step:,} tokens per step"),
        ("model", f"{_count(plan.num_parameters)} parameters{f' ({architecture})' if architecture else ''}; "
                  f"padded vocab {plan.padded_vocab_size} "
                  f"({vocab_size} + {plan.padded_vocab_size - vocab_size} padding)"),
        ("memory", _memory_line(plan)),
        ("flops", f"{plan.flops_per_token / 1e9:.2f} GFLOP per token ({plan.flops_formula}); "
                  f"6N gives {plan.flops_per_token_6n / 1e9:.2f}"),
        ("step time", _step_line(plan)),
        ("layout", plan.layout_choice),
        ("lr", _lr_line(resolved)),
        ("data", (data or data_summary(resolved)).line()),
        ("checkpoint", _checkpoint_line(resolved)),
    ]
    spares = resolved.cfg.launch.spare_nodes
    if spares:
        rows.insert(1, ("nodes", f"{plan.num_nodes} + {spares} hot spare{'s' if spares > 1 else ''} (idle until a "
                                 f"node fails; {plan.num_nodes + spares} billed)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plan_json(resolved: Resolved, *, data: DataSummary) -> dict[str, object]:
    """The plan's fields, with the data summary, the model's architecture as the planner counted it
    (plan/architecture.py) and the warnings (as `submit --json` has them) beside them."""
    from megatron_hpc.plan.architecture import features

    spares = resolved.cfg.launch.spare_nodes
    return {**resolved.plan.to_json(), "spare_nodes": spares, "billed_nodes": resolved.plan.num_nodes + spares,
            "data": data.to_json(), "model": features(resolved.cfg.model), "warnings": plan_warnings(resolved)}


def run(args: argparse.Namespace) -> int:
    resolved = resolve(args)
    data = data_summary(resolved)
    if args.json:
        print(json.dumps(plan_json(resolved, data=data), indent=2))
    else:
        print(format_plan(resolved, data=data))
        if args.explain:
            print("\n".join(explain_lines(resolved.plan)))
    for warning in plan_warnings(resolved):
        print(f"megatron-hpc: warning: {warning}", file=sys.stderr)
    return 0
