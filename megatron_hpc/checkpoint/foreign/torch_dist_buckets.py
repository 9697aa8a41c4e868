"""The distributed optimizer's dp_reshardable state (torch_dist_optim.py's bucket space) placed from the index, so
the streamed `ckpt convert` (torch_dist_stream.py) reads it a layer at a time instead of whole.

The whole read picks the module order and alignment by comparing every parameter's fp32 master in the flat buffers
with its weight, which needs every buffer. Here the candidates come from sizes alone (the index records each flat
tensor's length: a layout must fill it exactly, torch_dist_optim.layout), and each candidate is confirmed on a sample:
the stage's first and last layers, each read as one box of each weight and one of the buffer. The grad buffer lays
parameters out in reverse module order, so the first layer sits at the end of its bucket, after every other parameter
of the stage: a wrong order or alignment shifts it there even where it agrees earlier. The last layer sits at the
buffer's other end, after the stage's final norm and output layer where it has them, so damage at that end shows
too; each rank reads only its TP share of the sampled weights, so the sample costs about two layers of the stage's
weights and param buffer per rank. What it does not see is a buffer damaged in a middle layer; the whole read (no
--read-budget-gib) checks every parameter. Where no layout passes, the error names the first sampled
master that disagreed with its weight under the first layout that fits the lengths (megatron-core's own order).

Each parameter becomes a Flat: its TP pieces (a range of a flat key, the rank-local shape, where it goes in the
global tensor, as torch_dist_optim._place puts it). A tied embedding's last-stage copy is the one taken (its master
and both moments), as the whole read's later rank overwrites the first stage's; megatron-core keeps the two copies
equal (their gradients are summed over the embedding group), so either would do for its own files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron_hpc.checkpoint.foreign import torch_dist_optim as optim
from megatron_hpc.checkpoint.foreign.torch_dist_files import Box, TorchDistFolder, read

Param = optim.Param


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
        chosen, wrong = _confirmed(src, model, names, stages[p], tp=tp, rank=t, pp=pp, swiglu=swiglu, stage=p)
        if chosen is None:
            raise optim.layout_error(m, [int(src.keys[n["param"]].size[0]) for n in names], wrong)
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
               tp: int, rank: int, pp: int, swiglu: bool, stage: int
               ) -> tuple[optim.Placement | None, Param | None]:
    """(the first module order and alignment that fills the buckets' lengths and puts the sample's fp32 masters on
    their weights, torch_dist_optim._choose_layout's rule checked on the stage's first and last layers; else None and
    the first sampled parameter that disagreed under the first layout that fit the lengths, None if none fit)."""
    lengths = [int(src.keys[n["param"]].size[0]) for n in names]
    # One read per sampled layer: a box spanning both would cover the stage's whole buffer.
    sampled = list(dict.fromkeys([layers[0], layers[-1]])) if len(layers) else [None]
    wrong: Param | None = None
    for order in optim.LAYER_ORDERS:
        params = optim.rank_params(model, order, layers, first=stage == 0, last=stage == pp - 1, pp=pp)
        locals_ = [_local_shape(_shape(model, k, i), optim.local_ranges(k, torch.Size(_shape(model, k, i)), tp=tp,
                                                                         rank=rank, swiglu=swiglu)) for k, i in params]
        for align in optim.ALIGNMENTS:
            placed = optim.layout([math.prod(s) for s in locals_], lengths, align)
            if placed is None:
                continue
            for layer in sampled:
                sample = [j for j, (_, i) in enumerate(params) if layer is None or i == layer]
                bad = _sample_mismatch(src, [params[j] for j in sample], [placed[j] for j in sample], names, tp=tp,
                                       rank=rank, swiglu=swiglu)
                if bad is not None:
                    wrong = wrong or bad
                    break
            else:
                return list(zip(params, placed)), None
    return None, wrong


def _sample_mismatch(src: TorchDistFolder, params: list[Param], placed: list[tuple[int, int]],
                     names: list[dict[str, str]], *, tp: int, rank: int, swiglu: bool) -> Param | None:
    """The first of `params` (one layer's, or layer-less ones) whose fp32 master at `placed` is not its weight (None:
    all are), read as boxes: the span of each weight that TP rank `rank` holds, one span of each flat buffer."""
    boxes: dict[str, Box] = {}
    local: dict[str, optim.Ranges | None] = {}
    for (key, layer), (bucket, start) in zip(params, placed):
        full = tuple(src.keys[key].size)
        shape = full if layer is None else full[1:]
        local[key] = optim.local_ranges(key, torch.Size(shape), tp=tp, rank=rank, swiglu=swiglu)
        boxes[key] = _piece_box(full, layer, local[key])
        widen(boxes, names[bucket]["param"], start, start + math.prod(_local_shape(shape, local[key])))
    keys = sorted({key for key, _ in params} | {names[b]["param"] for b, _ in placed})
    tensors, _ = read(src, keys, boxes=boxes)
    for (key, layer), (bucket, start) in zip(params, placed):
        piece = tensors[key] if layer is None else tensors[key][0]
        ranges = local[key]
        if ranges is not None:  # the runs of the piece, counted from the box's start along its dim
            dim, runs = ranges
            lo = min(a for a, _ in runs)
            piece = piece.index_select(dim, torch.cat([torch.arange(a - lo, b - lo) for a, b in runs]))
        flat = names[bucket]["param"]
        offset = start - boxes[flat][0][0]
        master = tensors[flat][offset:offset + piece.numel()].to(piece.dtype).view(piece.shape)
        if not torch.equal(master, piece):
            return key, layer
    return None


def _piece_box(full: tuple[int, ...], layer: int | None, ranges: optim.Ranges | None) -> Box:
    """The box of a key of shape `full` (stacked when `layer` is set) that covers one TP rank's piece: that rank's
    span along the split dim (SwiGLU's gate and up rows, two runs, as the one span from the first to the last), so
    each rank's sample reads its share of the weight, not all of it."""
    offsets, sizes = [0] * len(full), list(full)
    if layer is not None:
        offsets[0], sizes[0] = layer, 1
    if ranges is not None:
        dim, runs = ranges
        at = dim + (layer is not None)
        lo, hi = min(a for a, _ in runs), max(b for _, b in runs)
        offsets[at], sizes[at] = lo, hi - lo
    return tuple(offsets), tuple(sizes)
