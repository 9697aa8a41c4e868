"""A reshard's target sizes: checked against the model before anything is read or written, set in every record of
the parallel sizes that each written state carries, and reported. The tensors are moved by stream.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_hpc.checkpoint.store import PipelineLayout
from megatron_hpc.errors import CheckpointError, PlanError


@dataclass(frozen=True, kw_only=True, slots=True)
class ReshardResult:
    folder: Path
    from_tp: int
    to_tp: int
    from_pp: int
    to_pp: int
    optimizer: str
    """resharded, or dropped (with the reason in `note`)."""
    note: str = ""


def check_tp(model: dict[str, Any], tp: int) -> None:
    heads = model["num_attention_heads"]
    ffn = model.get("ffn_hidden_size") or 4 * model["hidden_size"]
    groups = model.get("num_query_groups") or heads
    if tp < 1 or heads % tp or ffn % tp or groups % tp:
        choices = [d for d in range(1, heads + 1) if heads % d == 0 and ffn % d == 0 and groups % d == 0]
        what = "" if groups == heads else f" the {groups} key/value groups (model.num_query_groups),"
        raise CheckpointError(f"--tp {tp} must be at least 1 and divide{what} the {heads} attention heads and the FFN "
                              f"size {ffn}; use --tp in {choices}")


def check_pp(model: dict[str, Any], layout: PipelineLayout) -> None:
    layers = model["num_layers"]
    if layout.pipeline < 1 or layout.virtual < 1:
        raise CheckpointError(f"--pp {layout.pipeline} and --virtual-pipeline {layout.virtual} must be at least 1")
    try:
        layout.rank_layers(layers, 0)
    except PlanError as exc:
        even = [d for d in range(1, layers + 1) if layers % (d * layout.virtual) == 0]
        why = str(exc).split("; ")[0]  # the planner's fix names --set keys; here the fix is other flags
        raise CheckpointError(f"the checkpoint's {layers} layers do not split as {layout.describe()} ({why}); "
                              f"use --pp in {even} (with --virtual-pipeline {layout.virtual})") from None


def resized_state(state: dict[str, Any], *, tp: int, layout: PipelineLayout, padded: int) -> dict[str, Any]:
    """A copy of a state's non-tensor keys with every record of the parallel sizes set to the new ones, so that a run
    at those sizes accepts it (its resolved_config and resolved_plan included)."""
    out = {k: copy.deepcopy(v) for k, v in state.items() if k not in ("model", "optimizer")}
    out.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=layout.pipeline, padded_vocab_size=padded)
    parallel = out.setdefault("resolved_config", {}).setdefault("parallel", {})
    parallel.update(tensor=tp, pipeline=layout.pipeline, virtual_pipeline=layout.virtual,
                    pipeline_first_stage_layers=layout.first_stage_layers,
                    pipeline_last_stage_layers=layout.last_stage_layers)
    plan = out.get("resolved_plan")
    if isinstance(plan, dict):
        plan.update(tensor_parallel=tp, pipeline_parallel=layout.pipeline, padded_vocab_size=padded)
        if "virtual_pipeline" in plan or layout.virtual > 1:
            plan["virtual_pipeline"] = layout.virtual
    return out
