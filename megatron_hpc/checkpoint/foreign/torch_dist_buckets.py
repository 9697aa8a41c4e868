"""The distributed optimizer's dp_reshardable state (torch_dist_optim.py's bucket space) placed from the index, so
the streamed `ckpt convert` (torch_dist_stream.py) reads it a layer at a time instead of whole.

The whole read picks the module order and alignment by comparing every parameter's fp32 master in the flat buffers
with its weight, which needs every buffer. Here the candidates come from sizes alone (the index records each flat
tensor's length: a layout must fill it exactly, torch_dist_optim.layout), and each candidate is confirmed on a sample:
the stage's first layer, read as one box of each weight and one of the buffer. The grad buffer lays parameters out in
reverse module order, so the first layer sits at the end of its bucket, after every other parameter of the stage: a
wrong order or alignment shifts it there even where it agrees earlier. What the sample does not see is a buffer
damaged elsewhere; the whole read (no --read-budget-gib) checks every parameter.

Each parameter becomes a Flat: its TP pieces (a range of a flat key, the rank-local shape, where it goes in the
global tensor, as torch_dist_optim._place puts it). A tied embedding's last-stage copy is the one taken, as the whole
read's later rank overwrites the first stage's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron_hpc.checkpoint.foreign import torch_dist_optim as optim
from megatron_hpc.checkpoint.foreign.torch_dist_files import Box, TorchDistFolder, read

Param = tuple[str, int | None]
"""(model key, global layer or None)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One TP rank's part of a parameter in a flat buffer."""

    flat: str
    start: int
    shape: tuple[int, ...]
    """Rank-local shape; its numel elements from `start` are the part."""
    ranges: optim.Ranges | None
    """Where it goes in the global tensor (None: all of it, replicated)."""


@dataclass(frozen=True, slots=True)
class Flat:
    """One parameter's state (param, exp_avg or exp_avg_sq) in the flat buffers: its global shape and pieces."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketSpace:
    flats: dict[tuple[str, int | None, str], Flat]
    """(model key, global layer or None, param | exp_avg | exp_avg_sq) -> where it lies."""
    step: float | None
    hyper: dict[str, Any]

    def model_keys(self) -> list[str]:
        return list(dict.fromkeys(key for key, _, _ in self.flats))


def assemble(flat: Flat, tensors: dict[str, torch.Tensor], boxes: dict[str, Box]) -> torch.Tensor:
    """`flat`'s global fp32 tensor from its pieces' flat boxes (read as `boxes` name them). A copy even where one
    piece is all of it: a view would keep the unit's whole box alive for as long as an output rank holds it (tried:
    peak RSS 2.6 -> 3.2 GiB on the benchmark's source)."""
    whole = torch.zeros(flat.shape, dtype=torch.float32)
    for piece in flat.pieces:
        offset = piece.start - boxes[piece.flat][0][0]
        part = tensors[piece.flat][offset:offset + math.prod(piece.shape)].view(piece.shape).float()
        index = optim.index_of(piece.ranges)
        if index is None:
            whole.copy_(part)
        else:
            whole.index_copy_(index[0], index[1], part)
    return whole


def widen(boxes: dict[str, Box], key: str, start: int, end: int) -> None:
    """Grow `key`'s 1-D box in `boxes` to cover [start, end)."""
    if key in boxes:
        (lo,), (size,) = boxes[key]
        start, end = min(start, lo), max(end, lo + size)
    boxes[key] = ((start,), (end - start,))


def bucket_space(src: TorchDistFolder, model: dict[str, torch.Tensor], *, tp: int, pp: int, swiglu: bool,
                 num_layers: int) -> BucketSpace:
    """Where each parameter's state lies in the flat buffers, reading only a sample; `model` may be meta. ValueError
    with the reason when no layout fits (the caller drops the state with a note)."""
    found = optim.bucket_keys(src, tp=tp, pp=pp)
    hyper, step = optim.bucket_groups(src)
    stages = optim.stage_layers(num_layers, pp, src.common.get("args"))
    by_stage: dict[tuple[str, int | None, str], dict[int, list[Piece]]] = {}
    for m in range(tp * pp):
        p, t = divmod(m, tp)
        names = [found[m][b] for b in sorted(found[m])]
        chosen = _confirmed(src, model, names, stages[p], tp=tp, rank=t, pp=pp, swiglu=swiglu, stage=p)
        if chosen is None:
            raise optim.layout_error(m, [int(src.keys[n["param"]].size[0]) for n in names])
        for (key, layer), (bucket, start) in chosen:
            full = _shape(model, key, layer)
            ranges = optim.local_ranges(key, torch.Size(full), tp=tp, rank=t, swiglu=swiglu)
            local = _local_shape(full, ranges)
            for what in optim.KEYS:
                piece = Piece(names[bucket][what], start, local, ranges)
                by_stage.setdefault((key, layer, what), {}).setdefault(p, []).append(piece)
    flats = {where: Flat(_shape(model, where[0], where[1]), tuple(per[max(per)])) for where, per in by_stage.items()}
    return BucketSpace(flats=flats, step=step, hyper=hyper)


def _shape(model: dict[str, torch.Tensor], key: str, layer: int | None) -> tuple[int, ...]:
    return tuple(model[key].shape if layer is None else model[key].shape[1:])


def _local_shape(full: tuple[int, ...], ranges: optim.Ranges | None) -> tuple[int, ...]:
    if ranges is None:
        return full
    dim, runs = ranges
    return (*full[:dim], sum(hi - lo for lo, hi in runs), *full[dim + 1:])


def _confirmed(src: TorchDistFolder, model: dict[str, torch.Tensor], names: list[dict[str, str]], layers: range, *,
               tp: int, rank: int, pp: int, swiglu: bool, stage: int) -> list[tuple[Param, tuple[int, int]]] | None:
    """The first module order and alignment that fills the buckets' lengths and puts the sample's fp32 masters on
    their weights (torch_dist_optim._choose_layout's rule, checked on the stage's first layer)."""
    lengths = [int(src.keys[n["param"]].size[0]) for n in names]
    for order in optim.LAYER_ORDERS:
        params = optim.rank_params(model, order, layers, first=stage == 0, last=stage == pp - 1, pp=pp)
        locals_ = [_local_shape(_shape(model, k, i), optim.local_ranges(k, torch.Size(_shape(model, k, i)), tp=tp,
                                                                         rank=rank, swiglu=swiglu)) for k, i in params]
        for align in optim.ALIGNMENTS:
            placed = optim.layout([math.prod(s) for s in locals_], lengths, align)
            if placed is None:
                continue
            sample = [j for j, (_, i) in enumerate(params) if i == layers[0]] if len(layers) else range(len(params))
            if _sample_matches(src, [params[j] for j in sample], [placed[j] for j in sample], names, tp=tp,
                               rank=rank, swiglu=swiglu):
                return list(zip(params, placed))
    return None


def _sample_matches(src: TorchDistFolder, params: list[Param], placed: list[tuple[int, int]],
                    names: list[dict[str, str]], *, tp: int, rank: int, swiglu: bool) -> bool:
    """Whether each of `params`' fp32 masters at `placed` equals its weight (read as boxes: one layer, one span)."""
    boxes: dict[str, Box] = {}
    for (key, layer), (bucket, start) in zip(params, placed):
        full = tuple(src.keys[key].size)
        if layer is not None:
            boxes[key] = ((layer,) + (0,) * (len(full) - 1), (1, *full[1:]))
        shape = full if layer is None else full[1:]
        ranges = optim.local_ranges(key, torch.Size(shape), tp=tp, rank=rank, swiglu=swiglu)
        widen(boxes, names[bucket]["param"], start, start + math.prod(_local_shape(shape, ranges)))
    keys = sorted({key for key, _ in params} | {names[b]["param"] for b, _ in placed})
    tensors, _ = read(src, keys, boxes=boxes)
    for (key, layer), (bucket, start) in zip(params, placed):
        weight = tensors[key] if layer is None else tensors[key][0]
        index = optim.index_of(optim.local_ranges(key, weight.shape, tp=tp, rank=rank, swiglu=swiglu))
        local = weight if index is None else weight.index_select(index[0], index[1])
        flat = names[bucket]["param"]
        offset = start - boxes[flat][0][0]
        master = tensors[flat][offset:offset + local.numel()].to(local.dtype).view(local.shape)
        if not torch.equal(master, local):
            return False
    return True
