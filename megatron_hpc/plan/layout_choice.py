"""Choose TP x PP by predicted step time among the layouts that fit. Pure.

plan/sizing.py finds the first layout that fits in its search order (the smallest pipeline, then the smallest TP:
table 1 of Narayanan et al. 2021); that rule guarantees a fit, not speed. Here every TP x PP the recipe leaves free
(a size of 0) is tried with the same checks, each that fits is given a predicted step time (plan/steptime.py), and
the fastest is chosen. Sizes the recipe or --set pins stay pinned: with both pinned there is one candidate.

The rule's layout is kept when it predicts within CHOICE_MARGIN of the fastest: the model's resolution is coarser
than that (benchmarks/RESULTS.md, issue 29), and the rule's layout has the least model parallelism. On XLA, where a
pipeline does not run in this release, a pipelined layout is not chosen over one without.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_hpc.config.hardware import Hardware
from megatron_hpc.config.platforms import Platform
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.errors import MegatronHpcError
from megatron_hpc.plan.calibration import Calibration
from megatron_hpc.plan.checks import check_overlap_param_gather, check_sequence_parallel
from megatron_hpc.plan.memory import MemoryEstimate
from megatron_hpc.plan.model_math import flops_per_token
from megatron_hpc.plan.recompute import check_recompute_stages
from megatron_hpc.plan.sizing import Sizes, auto_tensor_candidates, fit_mesh, pipeline_candidates
from megatron_hpc.plan.steptime import Layout, StepTime, predict_step_time

CHOICE_MARGIN = 0.03
"""A layout must predict this much faster than the rule's to replace it."""
ALTERNATIVES_KEPT = 5
"""Next-best layouts the plan keeps for `plan --explain`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ranked:
    """A layout that fits, with its predicted step time."""

    sizes: Sizes
    time: StepTime

    @property
    def label(self) -> str:
        mesh = self.sizes.mesh
        return f"TP {mesh.tensor_parallel} x PP {mesh.pipeline_parallel} x DP {mesh.data_parallel}"

    def to_json(self) -> dict[str, object]:
        mesh = self.sizes.mesh
        return {"tensor_parallel": mesh.tensor_parallel, "pipeline_parallel": mesh.pipeline_parallel,
                "data_parallel": mesh.data_parallel, "num_micro_batches": self.sizes.num_micro_batches,
                "predicted_step_time_s": round(self.time.step_time_s, 6),
                "memory_per_worker_gib": round(self.sizes.memory.total_gib, 3), "limit": self.time.limit()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    chosen: Ranked
    alternatives: tuple[Ranked, ...]
    """The next best layouts that fit, fastest first (at most ALTERNATIVES_KEPT)."""
    reason: str
    evaluated: int
    """Layouts whose step time was predicted (every valid one)."""


def predict(cfg: RunConfig, sizes: Sizes, *, hardware: Hardware, calibration: Calibration) -> StepTime:
    """The predicted step time of one fitting layout."""
    mesh = sizes.mesh
    layout = Layout(tensor_parallel=mesh.tensor_parallel, pipeline_parallel=mesh.pipeline_parallel,
                    data_parallel=mesh.data_parallel, num_micro_batches=sizes.num_micro_batches,
                    stage_layers=tuple(len(r) for r in sizes.stage_layers), workers_per_node=mesh.workers_per_node,
                    padded_vocab=sizes.padded_vocab)
    return predict_step_time(cfg, layout, hardware=hardware, calibration=calibration,
                             flops_per_token=flops_per_token(cfg.model, padded_vocab=sizes.padded_vocab))


def fitting_layouts(cfg: RunConfig, platform: Platform, *, num_nodes: int, per_node: int) -> list[Sizes]:
    """Every TP x PP the recipe leaves free that passes the planner's checks and fits, in the rule's order."""
    world = num_nodes * per_node
    tps = [cfg.parallel.tensor] if cfg.parallel.tensor else auto_tensor_candidates(cfg, platform, per_node=per_node)
    found = []
    for tp in tps:
        pps = [cfg.parallel.pipeline] if cfg.parallel.pipeline else pipeline_candidates(cfg, world=world, tp=tp)
        for pp in pps:
            if world % (tp * pp) or cfg.train.micro_batch_size * world // (tp * pp) * pp > cfg.train.global_batch_size:
                continue  # no integer DP, or not a micro-batch per stage for every replica
            try:
                sizes = fit_mesh(cfg, platform, num_nodes=num_nodes, per_node=per_node, tp=tp, pp=pp)
                if isinstance(sizes, MemoryEstimate):
                    continue
                check_recompute_stages(cfg.model, [len(r) for r in sizes.stage_layers])
                check_sequence_parallel(cfg, tensor_parallel=tp)
                check_overlap_param_gather(cfg, pipeline_parallel=pp)
            except MegatronHpcError:
                continue
            found.append(sizes)
    return found


def choose_layout(cfg: RunConfig, platform: Platform, *, rule: Sizes, hardware: Hardware,
                  calibration: Calibration) -> Choice:
    """With parallel.choose_layout=fastest the fastest predicted layout among those that fit (the rule's within
    CHOICE_MARGIN), else the rule's; every layout that fits ranked, and why."""
    mesh = rule.mesh
    candidates = fitting_layouts(cfg, platform, num_nodes=mesh.num_nodes, per_node=mesh.workers_per_node)
    if platform.backend == "xla" and mesh.pipeline_parallel == 1:
        candidates = [s for s in candidates if s.mesh.pipeline_parallel == 1]
    if not any(s.mesh == mesh for s in candidates):  # the rule's checks differ in a corner: keep its layout
        candidates.insert(0, rule)
    ranked = sorted((Ranked(sizes=s, time=predict(cfg, s, hardware=hardware, calibration=calibration))
                     for s in candidates), key=lambda r: r.time.step_time_s)
    by_rule = next(r for r in ranked if r.sizes.mesh == mesh)
    fastest = ranked[0]
    close = by_rule.time.step_time_s <= fastest.time.step_time_s * (1 + CHOICE_MARGIN)
    chosen = by_rule if close or cfg.parallel.choose_layout == "fits" else fastest
    others = tuple(r for r in ranked if r is not chosen)[:ALTERNATIVES_KEPT]
    return Choice(chosen=chosen, alternatives=others, reason=_reason(cfg, chosen, by_rule, fastest, len(ranked)),
                  evaluated=len(ranked))


def _reason(cfg: RunConfig, chosen: Ranked, by_rule: Ranked, fastest: Ranked, count: int) -> str:
    pinned = [f"parallel.{k}={v}" for k, v in (("tensor", cfg.parallel.tensor), ("pipeline", cfg.parallel.pipeline))
              if v]
    pins = f" ({', '.join(pinned)} pinned)" if pinned else ""
    if count == 1:
        return f"the only layout that fits{pins}"
    time = f"{chosen.time.step_time_s:.3g} s"
    if cfg.parallel.choose_layout == "fits" and chosen is not fastest:
        gain = chosen.time.step_time_s / fastest.time.step_time_s - 1
        return (f"the first that fits in memory (parallel.choose_layout=fits){pins}; of {count} layouts that fit the "
                f"fastest predicted is {fastest.label}, {fastest.time.step_time_s:.3g} s against {time}"
                + (f" ({gain:.0%} faster): --set parallel.choose_layout=fastest picks it" if gain > CHOICE_MARGIN
                   else f", within {CHOICE_MARGIN:.0%}"))
    if chosen is by_rule and chosen is fastest:
        return f"fastest predicted ({time}) of {count} layouts that fit{pins}, and the least model parallelism"
    if chosen is by_rule:
        return (f"least model parallelism that fits; within {CHOICE_MARGIN:.0%} of the fastest predicted "
                f"({fastest.label}, {fastest.time.step_time_s:.3g} s) of {count} layouts that fit{pins}")
    gain = by_rule.time.step_time_s / chosen.time.step_time_s - 1
    return (f"fastest predicted ({time}) of {count} layouts that fit{pins}: {gain:.0%} faster than the least "
            f"model parallelism that fits, {by_rule.label} ({by_rule.time.limit()})")


def with_choice(sizes: Sizes, choice: Choice) -> Sizes:
    """The chosen layout's sizes, keeping what the rule found about idle workers."""
    return dataclasses.replace(choice.chosen.sizes, global_batch_for_all_workers=sizes.global_batch_for_all_workers)
