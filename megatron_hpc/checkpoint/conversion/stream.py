"""A checkpoint at another TP x PP size, written one output rank at a time (issue 16): what `ckpt convert`,
`ckpt reshard` and the Hugging Face import write through.

Each output rank (pp, tp) is made from only the source shards that hold its pieces, written by the saver's own
per-rank writer, and dropped before the next rank is made; the manifest, the rename and the tracker come last, as
write_whole does them. Each split output tensor is allocated once at its final size and filled by copying (and
casting) the overlapping slices of the source shards straight into it: no merged whole tensor, no clones. A source
weight is fetched through `Source.weight` when an output tensor needs it and let go through `Source.release` right
after its last use, so with lazily read sources (torch.load mmap, xser's per-tensor files) the peak is one output
rank's tensors plus the source pieces of the tensor being made.

What it writes equals a plain merge over TP and PP, re-pad of the vocabulary and split, tensor for tensor;
tests/unit/test_checkpoint_stream.py holds it to tests/unit/whole_model_reshard.py, which does just that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.conversion import optim_layout, pp_layout, tp_layout
from megatron_hpc.checkpoint.conversion.host_memory import give_back_freed
from megatron_hpc.checkpoint.conversion.parallel import in_workers, split_runs
from megatron_hpc.checkpoint.conversion.reshard_sizes import ReshardResult, check_pp, check_tp, resized_state
from megatron_hpc.checkpoint.conversion.whole import WholeCheckpoint, model_config
from megatron_hpc.checkpoint.store import (
    PipelineLayout,
    RankInfo,
    commit_save,
    staged_iteration,
    write_rank_folder,
)
from megatron_hpc.errors import CheckpointError
from megatron_hpc.plan.vocab import padded_vocab_size

Fetch = Callable[[int, int, str], torch.Tensor]
"""(pp_rank, tp_rank, name) -> that source rank's weight; any dtype (the copy into the output casts)."""
_VOCAB_ROWS = ("wte.weight", "lm_head.weight")


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """A checkpoint at its own TP x PP whose weights are fetched one at a time.

    `whole`'s model dicts give each weight's name, order, shape and output dtype (meta tensors will do); `weight`
    gives its values; `release` lets one go for good."""

    whole: WholeCheckpoint
    weight: Fetch
    release: Callable[[int, int, str], None]
    moment: Callable[[int, int, str, str], torch.Tensor] | None = None
    """(pp_rank, tp_rank, name, exp_avg | exp_avg_sq) -> that moment, for a whole whose optimizer state is meta too
    (None: the whole's optimizer dicts hold the values); `release` lets a name's moments go with its weight."""
    unit: Callable[[int, int, str], str] | None = None
    """(pp_rank, tp_rank, name) -> what the source reads together with that weight (one decoder layer, say), for a
    reader that asks for a unit's weights together (the Hugging Face export); None: each weight alone."""


def in_memory(whole: WholeCheckpoint) -> Source:
    """A Source over a checkpoint already read; releasing a weight leaves a meta tensor of its shape behind."""
    def weight(p: int, t: int, name: str) -> torch.Tensor:
        return whole.grid[p][t]["model"][name]

    def release(p: int, t: int, name: str) -> None:
        model = whole.grid[p][t]["model"]
        model[name] = model[name].to("meta")

    return Source(whole=whole, weight=weight, release=release)


def merged(source: Source) -> Source:
    """`source` as one rank (TP 1 x PP 1, the layers of every stage, each tensor whole), for the exports that take a
    whole model a part at a time (`--to hf`, `--to torch_dist`): a weight or moment is put together from its TP
    pieces (pp_layout.merge_grid's result, tensor by tensor) when fetched, and releasing it releases its pieces in
    every stage that holds it. The whole's model and Adam moments are meta; the rest is the first rank's state."""
    whole = source.whole
    if (whole.tensor_parallel, whole.pipeline_parallel) == (1, 1):
        return source
    grid = [[s["model"] for s in row] for row in whole.grid]
    shapes = merged_shapes(grid, source.weight, num_layers=model_config(whole)["num_layers"])
    holders = {n: [p for p, row in enumerate(grid) if n in row[0]] for n in shapes}
    first = {k: v for k, v in whole.first.items() if k != "optimizer"}
    first["model"] = shapes
    per_tp = _moments_by_name(whole)
    moments = source.moment
    if per_tp is not None:
        meta = {n: {k: _merged_meta(n, [m[n][k] for m in per_tp]) if torch.is_tensor(v) and v.ndim else v
                    for k, v in per_tp[0][n].items()} for n in shapes if all(n in m for m in per_tp)}
        groups = optim_layout.group_template(whole.first["optimizer"], whole.first["model"])
        first["optimizer"] = optim_layout.indexed(meta, model=shapes, groups=groups)
        if moments is None:  # the values are in the whole's optimizer dicts
            def moments(p: int, t: int, name: str, key: str) -> torch.Tensor:
                return per_tp[t][name][key]

    def pieces(name: str, fetch: Callable[[int], torch.Tensor]) -> torch.Tensor:
        tp = 1 if tp_layout.split_of(name) == "replicated" else whole.tensor_parallel
        return tp_layout.merge(name, [fetch(k) for k in range(tp)])

    def release(_p: int, _t: int, name: str) -> None:
        for p in holders[name]:
            for t in range(whole.tensor_parallel):
                source.release(p, t, name)

    def moment(_p: int, _t: int, name: str, key: str) -> torch.Tensor:
        assert moments is not None, "fetched only where the whole holds moments"
        return pieces(name, lambda k: moments(holders[name][0], k, name, key))

    one = WholeCheckpoint(found=whole.found, grid=[[first]])
    return Source(whole=one, weight=lambda _p, _t, n: pieces(n, lambda k: source.weight(holders[n][0], k, n)),
                  release=release, moment=moment if per_tp is not None else None,
                  unit=lambda _p, _t, n: n if pp_layout.layer_of(n) is None else f"layer {pp_layout.layer_of(n)}")


def _moments_by_name(whole: WholeCheckpoint) -> list[dict[str, optim_layout.Moments]] | None:
    """Each TP rank's moments by name over its stages (the first holder's), None when a rank has none or they are
    not the trainer's AdamW (the exports then write the weights only)."""
    if not all("optimizer" in s for row in whole.grid for s in row):
        return None
    try:
        return _per_tp_moments(whole)
    except (KeyError, ValueError, TypeError):
        return None


def _per_tp_moments(whole: WholeCheckpoint) -> list[dict[str, optim_layout.Moments]]:
    """Each TP rank's moments by name over its pipeline stages, in pipeline rank order (the first holder's, as for
    the weights); KeyError, ValueError or TypeError when the state is not the trainer's AdamW of this model."""
    per_tp: list[dict[str, optim_layout.Moments]] = []
    for t in range(whole.tensor_parallel):
        named: dict[str, optim_layout.Moments] = {}
        for row in whole.grid:
            for name, m in optim_layout.by_name(row[t]["model"], row[t]["optimizer"]).items():
                named.setdefault(name, m)
        per_tp.append(named)
    return per_tp


def merged_shapes(grid: list[list[dict[str, torch.Tensor]]], weight: Fetch, *,
                  num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """pp_layout.merged_shapes of a grid whose tensors may be meta: the tied embedding copies of later stages are
    compared by value (fetched), then left out of the merge of shapes."""
    tp = len(grid[0])
    per_tp = []
    for t in range(tp):
        stages = [row[t] for row in grid]
        holders = [p for p, stage in enumerate(stages) if pp_layout.SHARED in stage]
        for p in holders[1:]:
            placed: list[dict[str, torch.Tensor]] = [{} for _ in range(p + 1)]
            placed[holders[0]] = {pp_layout.SHARED: weight(holders[0], t, pp_layout.SHARED).float()}
            placed[p] = {pp_layout.SHARED: weight(p, t, pp_layout.SHARED).float()}
            pp_layout.merge_stages(placed)  # its check and its message: the copies must be equal
        meta = [{n: w.to("meta") for n, w in stage.items() if not (n == pp_layout.SHARED and holders
                                                                      and p != holders[0])}
                for p, stage in enumerate(stages)]
        per_tp.append(pp_layout.merge_stages(meta, num_layers=num_layers))
    names = list(per_tp[0])
    for r, shard in enumerate(per_tp[1:], start=1):
        if list(shard) != names:  # tp_layout.merge_model's check
            raise CheckpointError(f"TP rank {r} holds other weights than rank 0; the checkpoint is not one model")
    return {name: _merged_meta(name, [m[name] for m in per_tp]) for name in names}


def _meta(shape: list[int], like: torch.Tensor) -> torch.Tensor:
    # Built, not computed: torch.cat of meta tensors imports torch._dynamo, seconds of a convert's time.
    return torch.empty(shape, dtype=like.dtype, device="meta")


def _merged_meta(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """tp_layout.merge's result, as a meta tensor."""
    how = tp_layout.split_of(name)
    if how == "replicated" or len(shards) == 1:
        return shards[0]
    dim = 1 if how == "columns" else 0
    shape = list(shards[0].shape)
    shape[dim] = sum(s.shape[dim] for s in shards)
    dtype = shards[0].dtype
    for s in shards[1:]:  # as torch.cat would: an fp32 master shard beside a bf16 one is not rounded
        dtype = torch.promote_types(dtype, s.dtype)
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Plan:
    """Where each output tensor comes from: the pipeline rank holding it in the source and each source TP shard's
    length along the split dim."""

    stages: list[dict[str, torch.Tensor]]
    """Each output pipeline rank's weights (meta, full size, vocabulary re-padded) in model order."""
    full: dict[str, torch.Size]
    """Each output tensor's whole shape (vocabulary re-padded)."""
    holder: dict[str, int]
    shards: dict[str, list[torch.Size]]
    tp: int
    vocab: int


def _span(name: str, shape: torch.Size, tp: int, rank: int) -> tuple[int, int, int]:
    """(split dim, first, end) of output TP rank `rank`'s piece of the full tensor; dim -1 when replicated."""
    how = tp_layout.split_of(name)
    if how == "replicated":
        return -1, 0, 0
    dim = 1 if how == "columns" else 0
    size = shape[dim] // tp
    return dim, rank * size, (rank + 1) * size


def _sources(plan: _Plan, name: str, rank: int) -> list[int]:
    """The source TP shards output TP rank `rank`'s piece of `name` reads."""
    dim, first, end = _span(name, plan.full[name], plan.tp, rank)
    if dim < 0:
        return [0]
    out, start = [], 0
    lengths = [s[dim] for s in plan.shards[name]]
    total = sum(lengths)
    for k, length in enumerate(lengths):
        if max(first, start) < min(end, start + length, total):
            out.append(k)
        start += length
    if end > total:  # rows grown by re-padding repeat the last real token's row
        out.append(_row_owner(lengths, plan.vocab - 1)[0])
    return sorted(set(out))


def _row_owner(lengths: list[int], row: int) -> tuple[int, int]:
    """(shard, offset in it) of the merged tensor's row `row`."""
    start = 0
    for k, length in enumerate(lengths):
        if row < start + length:
            return k, row - start
        start += length
    raise IndexError(row)


def _piece(plan: _Plan, name: str, rank: int, like: torch.Tensor, fetch: Callable[[int], torch.Tensor],
           buffers: _Buffers) -> Any:
    """Output TP rank `rank`'s piece of `name` (or of one of its moments: `fetch(k)` gives source shard k's), in
    `like`'s dtype; tp_layout.split(repad_vocab(merge(...))) without the merged tensor."""
    shape = plan.full[name]
    dim, first, end = _span(name, shape, plan.tp, rank)
    if dim < 0:
        value = fetch(0)
        return value if value.dtype == like.dtype else value.to(like.dtype)
    lengths = [s[dim] for s in plan.shards[name]]
    total = sum(lengths)
    out_shape = list(shape)
    out_shape[dim] = end - first
    out = buffers.take(out_shape, like.dtype)
    start = 0
    for k, length in enumerate(lengths):
        lo, hi = max(first, start), min(end, start + length, total)
        if lo < hi:
            out.narrow(dim, lo - first, hi - lo).copy_(fetch(k).narrow(dim, lo - start, hi - lo))
        start += length
    if end > total:  # tp_layout.repad_vocab: grown rows repeat the last real token's row
        k, offset = _row_owner(lengths, plan.vocab - 1)
        lo = max(first, total)
        out.narrow(0, lo - first, end - lo).copy_(fetch(k).narrow(0, offset, 1).expand(end - lo, -1))
    return out


def _plan(whole: WholeCheckpoint, weight: Fetch, *, tp: int, layout: PipelineLayout, num_layers: int, vocab: int,
          padded: int) -> _Plan:
    """Every check a merge-then-split makes (pp_layout.merge_stages', tp_layout.merge_model's and split's,
    pp_layout.split_stages') before anything is written, on shapes (and the tied copies' values)."""
    grid = [[s["model"] for s in row] for row in whole.grid]
    shapes = merged_shapes(grid, weight, num_layers=num_layers)
    for name in _VOCAB_ROWS:
        if name in shapes:  # tp_layout.repad_vocab: `padded` rows
            shapes[name] = _meta([padded, *shapes[name].shape[1:]], shapes[name])
    for name, meta in shapes.items():
        dim, _, _ = _span(name, meta.shape, tp, 0)
        if dim >= 0 and meta.shape[dim] % tp:  # tp_layout.split's check and message
            raise CheckpointError(f"{name} has {meta.shape[dim]} {'columns' if dim else 'rows'}, not divisible by "
                                  f"tp={tp}; pick a TP size that divides the heads and the FFN size")
    stages = pp_layout.split_stages(shapes, layout=layout, num_layers=num_layers)
    holder = {n: next(p for p, row in enumerate(grid) if n in row[0]) for n in shapes}
    shards = {n: [row[holder[n]][n].shape for row in zip(*grid)] for n in shapes}
    return _Plan(stages=stages, full={n: w.shape for n, w in shapes.items()}, holder=holder, shards=shards, tp=tp,
                 vocab=vocab)


def _optimizer_plan(whole: WholeCheckpoint, plan: _Plan) -> tuple[list[dict[str, optim_layout.Moments]],
                                                                  list[dict[str, Any]]]:
    """Each source TP rank's moments by name (_per_tp_moments), checked against the plan's shards, and the
    param groups' settings; KeyError, ValueError or TypeError when the state is not the trainer's AdamW of this model
    (checked before anything is written)."""
    per_tp = _per_tp_moments(whole)
    for t, merged in enumerate(per_tp):
        for name, moments in merged.items():
            want = plan.shards[name][t]
            for key, value in moments.items():
                if torch.is_tensor(value) and value.ndim and value.shape != want:
                    raise ValueError(f"{name}'s {key} on tp rank {t} is {tuple(value.shape)}, its weight "
                                     f"{tuple(want)}")
    groups = optim_layout.group_template(whole.first["optimizer"], whole.first["model"])
    return per_tp, groups


class _Buffers:
    """Output tensors handed from one written rank to the next of the same shapes: fresh memory costs a page fault
    and the kernel's zeroing per 4 KiB, more than the copy that fills it (about 2x on the benchmark's VM)."""

    def __init__(self) -> None:
        self._made: list[torch.Tensor] = []
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._budget: dict[tuple[tuple[int, ...], torch.dtype], int] = {}

    def take(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((tuple(shape), dtype))
        out = free.pop() if free else torch.empty(shape, dtype=dtype)
        self._made.append(out)
        return out

    def keep_only(self, wanted: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Drop what the next rank will not take, so the peak stays one rank (pipeline stages differ)."""
        counts: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
        for key in wanted:
            counts[key] = counts.get(key, 0) + 1
        self._free = {k: v[:counts[k]] for k, v in self._free.items() if k in counts}
        self._budget = counts

    def recycle(self) -> None:
        """The written rank's tensors become free (the writer has returned: nothing reads them any more)."""
        for t in self._made:
            key = (tuple(t.shape), t.dtype)
            free = self._free.setdefault(key, [])
            if len(free) < self._budget.get(key, 0):
                free.append(t)
        self._made = []


def _pieces_of(rank: tuple[int, int], plan: _Plan, per_tp: list[dict[str, optim_layout.Moments]] | None
               ) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor _piece allocates for output rank (pp_rank, tp_rank)."""
    p, t = rank
    out = []
    for name, meta in plan.stages[p].items():
        dim, first, end = _span(name, meta.shape, plan.tp, t)
        if dim < 0:
            continue
        shape = list(meta.shape)
        shape[dim] = end - first
        out.append((tuple(shape), meta.dtype))
        if per_tp is not None and all(name in m for m in per_tp):
            out += [(tuple(shape), v.dtype) for v in per_tp[0][name].values() if torch.is_tensor(v) and v.ndim]
    return out


def _last_uses(plan: _Plan, ranks: list[tuple[int, int]]) -> dict[tuple[int, int, str], int]:
    """For each source (pp_rank, tp_rank, name): the index in `ranks` of the last output rank that reads it."""
    last: dict[tuple[int, int, str], int] = {}
    for i, (p, t) in enumerate(ranks):
        for name in plan.stages[p]:
            for k in _sources(plan, name, t):
                last[(plan.holder[name], k, name)] = i
    return last


def _moments_piece(plan: _Plan, name: str, rank: int, per_tp: list[dict[str, optim_layout.Moments]],
                   buffers: _Buffers, source: Source) -> dict[str, Any]:
    """The moments of `name` for output TP rank `rank`, split like the weight (step counts as they are)."""
    out = {}
    h, moment = plan.holder[name], source.moment
    for key, first in per_tp[0][name].items():
        if not torch.is_tensor(first) or first.ndim == 0:
            out[key] = first  # the step count, the same on every rank
        elif moment is not None:
            out[key] = _piece(plan, name, rank, first, lambda k, key=key: moment(h, k, name, key), buffers)
        else:
            out[key] = _piece(plan, name, rank, first, lambda k, key=key: per_tp[k][name][key],
                              buffers)
    return out


def _release_moments(moments: optim_layout.Moments) -> None:
    for key, value in moments.items():
        if torch.is_tensor(value) and value.ndim:
            moments[key] = value.to("meta")


@dataclass(kw_only=True)
class _RankJob:
    """What writing a run of output ranks needs (planned once, before any worker forks)."""

    source: Source
    plan: _Plan
    per_tp: list[dict[str, optim_layout.Moments]] | None
    groups: Any
    whole: WholeCheckpoint
    tp: int
    pp: int
    layout: PipelineLayout
    padded: int
    fmt: str

    def write(self, ranks: list[tuple[int, int]], tmp: Path) -> None:
        """Write output ranks `ranks` (pp_rank, tp_rank) into `tmp`, releasing each source tensor after the last of
        them that reads it. In a forked worker what it releases is its own copy: the others still hold theirs."""
        source, plan, per_tp, whole = self.source, self.plan, self.per_tp, self.whole
        last = _last_uses(plan, ranks)
        for row_p, row in enumerate(whole.grid):  # what none of these reads (other TP ranks' replicated copies, ...)
            for t, state in enumerate(row):
                for name in list(state["model"]):
                    if (row_p, t, name) not in last:
                        source.release(row_p, t, name)
        buffers = _Buffers()
        for i, (p, t) in enumerate(ranks):
            state = resized_state(whole.first, tp=self.tp, layout=self.layout, padded=self.padded)
            weights: dict[str, torch.Tensor] = {}
            moments: dict[str, optim_layout.Moments] = {}
            for name, meta in plan.stages[p].items():
                h = plan.holder[name]
                weights[name] = _piece(plan, name, t, meta, lambda k, n=name, h=h: source.weight(h, k, n),
                                       buffers)
                if per_tp is not None and all(name in m for m in per_tp):
                    moments[name] = _moments_piece(plan, name, t, per_tp, buffers, source)
                for k in _sources(plan, name, t):
                    if last[(h, k, name)] == i:
                        source.release(h, k, name)
                        if per_tp is not None and name in per_tp[k]:
                            _release_moments(per_tp[k][name])
            state["model"] = weights
            if per_tp is not None:
                state["optimizer"] = optim_layout.indexed(moments, model=weights, groups=self.groups)
            buffers.keep_only(_pieces_of(ranks[i + 1], plan, per_tp) if i + 1 < len(ranks) else [])
            write_rank_folder(state, tmp, tp_rank=t, pp_rank=p, pp_size=self.pp, fmt=self.fmt)
            del state, weights, moments
            buffers.recycle()
            give_back_freed()


def reshard(source: Source, *, tp: int, pp: int = 1, virtual: int = 1, first_stage_layers: int = 0,
            last_stage_layers: int = 0, out: Path, fmt: str | None = None, workers: int = 1) -> ReshardResult:
    """Write `source` at TP size `tp` and pipeline size `pp` (with `virtual` chunks per pipeline rank and optional
    uneven first/last stages, as parallel.* names them) into `out`: same iteration, the vocabulary re-padded for
    `tp`, Adam's moments moved by name (dropped, with the reason in the result's note, when they cannot be). Every
    check and refusal comes before anything is written. `source`'s weights and moments are released as they are
    used (the checkpoint is unusable afterwards). With `workers` above 1 the output ranks are split into that many
    runs of consecutive ranks, each written by its own forked process (parallel.py)."""
    whole = source.whole
    model = model_config(whole)
    layout = PipelineLayout(pipeline=pp, virtual=virtual, first_stage_layers=first_stage_layers,
                            last_stage_layers=last_stage_layers)
    check_tp(model, tp)
    check_pp(model, layout)
    fmt = fmt or whole.found.manifest.format
    if fmt not in ("xser", "torch"):
        raise CheckpointError(f"format {fmt!r} is not supported; use xser or torch")
    vocab, layers = model["vocab_size"], model["num_layers"]
    padded = padded_vocab_size(vocab, divisible_by=model.get("make_vocab_size_divisible_by", 128), tensor_parallel=tp)
    plan = _plan(whole, source.weight, tp=tp, layout=layout, num_layers=layers, vocab=vocab, padded=padded)
    note, per_tp, groups = "", None, None
    if not all("optimizer" in s for row in whole.grid for s in row):
        note = "the checkpoint holds no optimizer state; a resumed run starts Adam's moments at zero"
    else:
        try:
            per_tp, groups = _optimizer_plan(whole, plan)
        except (KeyError, ValueError, TypeError, IndexError, CheckpointError) as exc:
            note = f"the optimizer state could not be resharded ({exc}); a resumed run starts Adam's moments at zero"
    ranks = [(p, t) for p in range(pp) for t in range(tp)]
    job = _RankJob(source=source, plan=plan, per_tp=per_tp, groups=groups, whole=whole, tp=tp, pp=pp, layout=layout,
                   padded=padded, fmt=fmt)
    runs = split_runs(ranks, workers)
    with staged_iteration(out, whole.iteration) as tmp:
        in_workers(runs, lambda mine: job.write(mine, tmp))
        folder = commit_save(tmp, out, whole.iteration, ranks=RankInfo(world_size=tp * pp, tp_size=tp, pp_size=pp),
                         fmt=fmt, layout=layout)
    return ReshardResult(folder=folder, from_tp=whole.tensor_parallel, to_tp=tp, from_pp=whole.pipeline_parallel,
                         to_pp=pp, optimizer="dropped" if per_tp is None else "resharded", note=note)
