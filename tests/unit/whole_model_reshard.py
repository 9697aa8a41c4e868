"""The plain merge-then-split reshard: the whole model merged over TP and PP, the vocabulary re-padded, split again
for the new sizes, Adam's moments moved the same way by name, and the grid written in one go.

This is the reference tests/unit/test_checkpoint_stream.py checks the streamed writer (stream.reshard, which every
command uses) against, tensor for tensor: an independent oracle that builds each output tensor the obvious way
(torch.cat, then torch.chunk) where stream.py copies overlapping slices into preallocated pieces. It shares only the
library's building blocks (tp_layout, pp_layout, optim_layout, the size checks and records, write_whole), not the
streamed writer's algorithm. Not part of the package: it holds the model about three times (once with `release`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.conversion import (
    WholeCheckpoint,
    give_back_freed,
    model_config,
    optim_layout,
    pp_layout,
    tp_layout,
)
from megatron_hpc.checkpoint.conversion.reshard_sizes import ReshardResult, check_pp, check_tp, resized_state
from megatron_hpc.checkpoint.conversion.whole import write_whole
from megatron_hpc.checkpoint.store import PipelineLayout
from megatron_hpc.errors import CheckpointError
from megatron_hpc.plan.vocab import padded_vocab_size


def reshard(whole: WholeCheckpoint, *, tp: int, pp: int = 1, virtual: int = 1, first_stage_layers: int = 0,
            last_stage_layers: int = 0, out: Path, fmt: str | None = None, release: bool = False) -> ReshardResult:
    """Write `whole` at TP size `tp` and pipeline size `pp` (with `virtual` chunks per pipeline rank and optional
    uneven first/last stages, as parallel.* names them) into `out`: same iteration, the vocabulary re-padded for
    `tp`, Adam's moments moved by name (dropped, with the reason in the result's note, when they cannot be).

    `release`: let go of `whole`'s weights as their new pieces are made (they become meta tensors of their shape), so
    the model is held about once instead of three times; `whole`'s weights are unusable afterwards."""
    model = model_config(whole)
    layout = PipelineLayout(pipeline=pp, virtual=virtual, first_stage_layers=first_stage_layers,
                            last_stage_layers=last_stage_layers)
    check_tp(model, tp)
    check_pp(model, layout)
    vocab, layers = model["vocab_size"], model["num_layers"]
    padded = padded_vocab_size(vocab, divisible_by=model.get("make_vocab_size_divisible_by", 128), tensor_parallel=tp)
    models = _split_models(whole, tp=tp, layout=layout, num_layers=layers, vocab=vocab, padded=padded,
                           release=release)
    note, optimizers = "", None
    if not all("optimizer" in s for row in whole.grid for s in row):
        note = "the checkpoint holds no optimizer state; a resumed run starts Adam's moments at zero"
    else:
        try:
            optimizers = _reshard_optimizer(whole, models, vocab=vocab, padded=padded)
        except (KeyError, ValueError, TypeError, IndexError, CheckpointError) as exc:
            note = f"the optimizer state could not be resharded ({exc}); a resumed run starts Adam's moments at zero"
    grid = []
    for p, row in enumerate(models):
        states = []
        for t, weights in enumerate(row):
            state = resized_state(whole.first, tp=tp, layout=layout, padded=padded)
            state["model"] = weights
            if optimizers is not None:
                state["optimizer"] = optimizers[p][t]
            states.append(state)
        grid.append(states)
    folder = write_whole(out, whole.iteration, grid, fmt=fmt or whole.found.manifest.format, layout=layout)
    return ReshardResult(folder=folder, from_tp=whole.tensor_parallel, to_tp=tp, from_pp=whole.pipeline_parallel,
                         to_pp=pp, optimizer="dropped" if optimizers is None else "resharded", note=note)


def _split_models(whole: WholeCheckpoint, *, tp: int, layout: PipelineLayout, num_layers: int, vocab: int,
                  padded: int, release: bool) -> list[list[dict[str, torch.Tensor]]]:
    """The new [pp_rank][tp_rank] grid of model dicts: pp_layout.split_grid of the merged, re-padded model, made one
    weight at a time (merge, re-pad, split), so that only one merged weight exists at once and, with `release`, the
    old weights go as their pieces are made."""
    grid = [[s["model"] for s in row] for row in whole.grid]
    per_tp = [pp_layout.merge_stages([row[t] for row in grid], num_layers=num_layers) for t in range(len(grid[0]))]
    shapes = tp_layout.merge_model([{n: w.to("meta") for n, w in m.items()} for m in per_tp])  # the checks, no data
    vocab_rows = ("wte.weight", "lm_head.weight")
    for name in vocab_rows:
        if name in shapes:
            shapes[name] = tp_layout.repad_vocab(shapes[name], vocab_size=vocab, padded=padded)
    stages = pp_layout.split_stages(shapes, layout=layout, num_layers=num_layers)
    out: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(tp)] for _ in stages]
    for name in shapes:
        full = tp_layout.merge(name, [m.pop(name) for m in per_tp])
        if release:
            for row in grid:
                for m in row:
                    if name in m:
                        m[name] = m[name].to("meta")  # the optimizer's reshard still reads names and shapes
        if name in vocab_rows:
            full = tp_layout.repad_vocab(full, vocab_size=vocab, padded=padded)
        pieces = tp_layout.split(name, full, tp)
        del full
        if release:
            give_back_freed()
        for p, stage in enumerate(stages):
            if name in stage:
                for t in range(tp):
                    out[p][t][name] = pieces[t]
    return [[{n: out[p][t][n] for n in stage} for t in range(tp)] for p, stage in enumerate(stages)]


def _reshard_optimizer(whole: WholeCheckpoint, models: list[list[dict[str, torch.Tensor]]], *, vocab: int,
                       padded: int) -> list[list[dict[str, Any]]]:
    """Each new rank's optimizer state: the old ranks' moments by name, merged over TP and PP like the weights and
    split again (ValueError or KeyError when the old state is not the trainer's AdamW of this model)."""
    tp = len(models[0])
    per_tp: list[dict[str, optim_layout.Moments]] = []
    for t in range(whole.tensor_parallel):
        merged: dict[str, optim_layout.Moments] = {}
        for row in whole.grid:  # pp order: rank 0's copy of tied embeddings wins, as for the weights
            for name, moments in optim_layout.by_name(row[t]["model"], row[t]["optimizer"]).items():
                merged.setdefault(name, moments)
        per_tp.append(merged)
    new: list[dict[str, optim_layout.Moments]] = [{} for _ in range(tp)]
    for name in per_tp[0]:
        per_rank = [m.get(name) for m in per_tp]
        if any(p is None for p in per_rank):
            continue  # never stepped: no moments to move
        for key in per_rank[0]:
            values = [p[key] for p in per_rank]
            if not torch.is_tensor(values[0]) or values[0].ndim == 0:
                pieces = [values[0]] * tp  # the step count, the same on every rank
            else:
                full = tp_layout.merge(name, values)
                if tp_layout.split_of(name) == "vocab":
                    full = tp_layout.repad_vocab(full, vocab_size=vocab, padded=padded)
                pieces = tp_layout.split(name, full, tp)
            for rank in range(tp):
                new[rank].setdefault(name, {})[key] = pieces[rank]
    groups = optim_layout.group_template(whole.first["optimizer"], whole.first["model"])
    return [[optim_layout.indexed(new[t], model=row[t], groups=groups) for t in range(tp)] for row in models]
