"""Which weights each pipeline rank's checkpoint holds, and merging / splitting whole models by it. Pure.

A pipeline rank's `model` is a flat dict in the PP=1 model's key names with global layer indices
(`h.{i}.attn.qkv.weight`), restricted to the layers of all its virtual chunks (plan/stages.py decides which).
Pipeline rank 0 also holds the word embeddings (`wte.weight`) and learned positions (`wpe.weight`); the last
rank holds the final norm (`ln_f.*`) and the output layer: `lm_head.weight` when untied, else its own copy of
`wte.weight` (Megatron's word_embeddings_for_head, kept equal to rank 0's by the embedding group's gradient
all-reduce). Within one pipeline rank, TP splits each tensor as tp_layout.py says; a grid of states is indexed
[pp_rank][tp_rank].
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from megatron_hpc.checkpoint.conversion import tp_layout
from megatron_hpc.checkpoint.store import PipelineLayout
from megatron_hpc.errors import CheckpointError, PlanError

FIRST_STAGE = ("wte.weight", "wpe.weight")
"""Held by pipeline rank 0."""
LAST_STAGE = ("ln_f.weight", "ln_f.bias", "lm_head.weight")
"""Held by the last pipeline rank (and with tied embeddings a copy of wte.weight)."""
SHARED = "wte.weight"
"""The one key two pipeline ranks may both hold (tied embeddings)."""

_LAYER = re.compile(r"^h\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The global layer index of a transformer-layer key, None for the embeddings and the head."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def _rank(name: str) -> tuple[int, int]:
    """Sort key of the PP=1 model's order: embeddings, layers ascending, final norm, output layer."""
    if name in FIRST_STAGE:
        return (0, FIRST_STAGE.index(name))
    layer = layer_of(name)
    if layer is not None:
        return (1, layer)
    return (2, LAST_STAGE.index(name) if name in LAST_STAGE else len(LAST_STAGE))


def model_order(names: Iterable[str]) -> list[str]:
    """`names` in the PP=1 model's order (the keys of one layer keep their relative order: sorting is stable)."""
    return sorted(names, key=_rank)


def rank_layers(layout: PipelineLayout, *, num_layers: int, pp_rank: int) -> list[int]:
    """The layers pipeline rank `pp_rank` holds; CheckpointError when the layout does not fit the model."""
    try:
        return layout.rank_layers(num_layers, pp_rank)
    except PlanError as exc:
        raise CheckpointError(f"the model's {num_layers} layers do not split as {layout.describe()}: {exc}") from None


def merge_stages(stages: list[dict[str, torch.Tensor]], *, num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """One TP rank's whole model from its pipeline ranks' model dicts (in pp order), in the PP=1 model's order.

    The tied embedding copy of the last stage must equal rank 0's, and rank 0's is kept. With `num_layers`, the
    stages must hold layers 0 .. num_layers - 1 exactly once.
    """
    merged: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for pp_rank, stage in enumerate(stages):
        for name, tensor in stage.items():
            if name not in merged:
                merged[name], owner[name] = tensor, pp_rank
            elif name != SHARED:
                raise CheckpointError(f"{name} is held by pipeline ranks {owner[name]} and {pp_rank}; the checkpoint "
                                      "is not one model split into stages")
            elif not torch.equal(merged[name], tensor):
                diff = (merged[name].float() - tensor.float()).abs().max().item()
                raise CheckpointError(f"the tied word embeddings of pipeline ranks {owner[name]} and {pp_rank} "
                                      f"differ (max {diff:.3g}): the run that saved it did not keep them equal, so "
                                      "the checkpoint has no single model to reshard")
    if num_layers is not None:
        found = {layer for layer in map(layer_of, merged) if layer is not None}
        if found != set(range(num_layers)):
            missing = sorted(set(range(num_layers)) - found)
            raise CheckpointError(f"the pipeline stages hold layers {sorted(found)} of {num_layers} (missing "
                                  f"{missing}); the checkpoint is incomplete or not one model")
    return {name: merged[name] for name in model_order(merged)}


def split_stages(full: dict[str, torch.Tensor], *, layout: PipelineLayout,
                 num_layers: int) -> list[dict[str, torch.Tensor]]:
    """Each pipeline rank's model dict from a whole model, in the PP=1 model's order.

    Tied embeddings (no lm_head.weight) give the last rank its own `wte.weight` (the same values).
    """
    p = layout.pipeline
    tied = "lm_head.weight" not in full
    stages: list[dict[str, torch.Tensor]] = []
    placed: set[str] = set()
    for pp_rank in range(p):
        layers = set(rank_layers(layout, num_layers=num_layers, pp_rank=pp_rank))
        mine = {}
        for name in model_order(full):
            layer = layer_of(name)
            if ((layer is not None and layer in layers) or (pp_rank == 0 and name in FIRST_STAGE)
                    or (pp_rank == p - 1 and (name in LAST_STAGE or (tied and name == SHARED)))):
                mine[name] = full[name]
                placed.add(name)
        stages.append(mine)
    unplaced = [n for n in full if n not in placed]
    if unplaced:
        raise CheckpointError(f"{unplaced[:3]} belong to no pipeline stage (layers 0 .. {num_layers - 1}, "
                              f"embeddings {FIRST_STAGE}, head {LAST_STAGE}); the checkpoint is not our GPT")
    return stages


def merge_grid(grid: list[list[dict[str, torch.Tensor]]], *, num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """The whole unsharded model from a [pp_rank][tp_rank] grid of model dicts."""
    tp = len(grid[0])
    per_tp = [merge_stages([row[t] for row in grid], num_layers=num_layers) for t in range(tp)]
    return tp_layout.merge_model(per_tp)


def merged_shapes(grid: list[list[dict[str, torch.Tensor]]], *,
                  num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """merge_grid's names, order and shapes as meta tensors, with its checks, without building the whole model."""
    tp = len(grid[0])
    per_tp = [merge_stages([row[t] for row in grid], num_layers=num_layers) for t in range(tp)]
    return tp_layout.merge_model([{n: w.to("meta") for n, w in m.items()} for m in per_tp])


def split_grid(full: dict[str, torch.Tensor], *, tp: int, layout: PipelineLayout,
               num_layers: int) -> list[list[dict[str, torch.Tensor]]]:
    """A [pp_rank][tp_rank] grid of model dicts from the whole model (vocabulary already padded for `tp`)."""
    return [tp_layout.split_model(stage, tp) for stage in split_stages(full, layout=layout, num_layers=num_layers)]
