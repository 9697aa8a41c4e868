"""A Megatron-family checkpoint as ours: every rank's weights, Adam moments, progress and RNG under our names, at the
source's TP x PP, ready for stream.reshard to write at any TP x PP (and re-pad the vocabulary).

Per rank: the model (each virtual chunk) is renamed (foreign_keys.py), its stage-local layer numbers made global
(chunks in Megatron's order: chunk 0 of every pipeline rank, then chunk 1, ...), QKV rows put in our order, and each
weight replaced by its fp32 master copy where a 16-bit run kept one (else it stays in the source's dtype). The
optimizer's positions become names (foreign_optim.py), or, with Megatron's distributed optimizer, its flat buffers in
distrib_optim.pt are cut back into parameters (distrib_optim.py); then they take our trainer's positions. With
SwiGLU each rank's fused fc ([gate_r; up_r]) is cut into our gate and fc, in the weights, masters and moments alike.
The model config comes from the saved arguments through megatron_args.py (the mapping torch_dist.py uses too). Progress:
iteration, consumed samples (the reference's flat keys or Megatron-LM's `args`), and the LR position: the scheduler's
num_steps counts samples (Megatron steps it by the global batch after every applied update), so applied steps =
num_steps / global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_hpc.checkpoint.conversion import (
    WholeCheckpoint,
    give_back_freed,
    optim_layout,
    pp_layout,
    stream,
    tp_layout,
)
from megatron_hpc.checkpoint.foreign import distrib_optim, foreign_keys, foreign_optim, megatron_args
from megatron_hpc.checkpoint.foreign.megatron_family import OURS, ForeignCheckpoint, arg, read_rank
from megatron_hpc.checkpoint.store import FoundCheckpoint, Manifest
from megatron_hpc.errors import CheckpointError


@dataclass(frozen=True, kw_only=True, slots=True)
class Imported:
    whole: WholeCheckpoint
    family: str
    notes: list[str] = field(default_factory=list)
    """What was not carried over, and why (one line each)."""
    source: stream.Source | None = None
    """With import_foreign(lazy=True): the weights' values, one at a time (the whole's model dicts are meta)."""


def _chunks(state: dict[str, Any], *, where: object) -> list[dict[str, Any]]:
    """The model's virtual chunks: `model`, or `model0`, `model1`, ... (Megatron with virtual pipelining)."""
    if "model" in state:
        return [state["model"]]
    count = sum(1 for k in state if isinstance(k, str) and k.startswith("model") and k[5:].isdigit())
    if count == 0 or any(f"model{i}" not in state for i in range(count)):
        raise CheckpointError(f"{where} has no model weights ('model' or 'model0', 'model1', ...); pass a checkpoint "
                              "that holds the model")
    return [state[f"model{i}"] for i in range(count)]


def _renamed(src: ForeignCheckpoint, *, tied: bool) -> tuple[list[list[dict[str, torch.Tensor]]],
                                                               dict[tuple[int, int], int]]:
    """Every rank's weights under our names, layers numbered globally; and the first global layer of each
    (pipeline rank, chunk)."""
    files = src.files
    counts: dict[tuple[int, int], int] = {}
    local: list[list[list[dict[str, Any]]]] = []
    for p, row in enumerate(src.grid):
        local.append([])
        for t, state in enumerate(row):
            where = files.mains[(p, t)]
            chunks = [foreign_keys.map_names(foreign_keys.flatten(c), family=src.family, tied=tied, where=where)
                      for c in _chunks(state, where=where)]
            for v, chunk in enumerate(chunks):
                n = foreign_keys.num_layers(list(chunk))
                if counts.setdefault((p, v), n) != n:
                    raise CheckpointError(f"the TP shards of {files.folder} disagree: {where} holds {n} layers in "
                                          f"chunk {v}, tp rank 0 {counts[(p, v)]}; they are not one model")
            local[-1].append(chunks)
    virtual = len(local[0][0])
    offset, offsets = 0, {}
    for v in range(virtual):  # Megatron's chunk order: chunk 0 of every stage, then chunk 1, ...
        for p in range(len(local)):
            offsets[(p, v)] = offset
            offset += counts.get((p, v), 0)
    return [[{foreign_keys.renumber(name, offsets[(p, v)]): t for v, chunk in enumerate(chunks)
              for name, t in chunk.items()} for chunks in row] for p, row in enumerate(local)], offsets


def _check_tp_agree(row: list[dict[str, torch.Tensor]], *, where: object,
                    value: Callable[[int, str], torch.Tensor] | None = None) -> None:
    """The TP shards of one pipeline rank are one model: the same weights, split shapes alike, copies equal.

    `value(tp_rank, name)`: a weight's values where `row` holds only shapes (default: `row`'s tensors)."""
    names = sorted(row[0])
    for t, shard in enumerate(row[1:], start=1):
        if sorted(shard) != names:
            extra = sorted(set(shard) ^ set(names))[:3]
            raise CheckpointError(f"the TP shards of {where} disagree: tp rank {t} and rank 0 hold different weights "
                                  f"({extra}); they are not one model")
    for name in names:
        first = row[0][name]
        for t, shard in enumerate(row[1:], start=1):
            other = shard[name]
            if other.shape != first.shape:
                raise CheckpointError(f"the TP shards of {where} disagree: {name} is {tuple(other.shape)} on tp rank "
                                      f"{t} and {tuple(first.shape)} on rank 0; they are not one model")
            if tp_layout.split_of(name) == "replicated":
                a, b = (first, other) if value is None else (value(0, name), value(t, name))
                if a.dtype == b.dtype and torch.equal(a, b):
                    continue  # the usual case, decided without fp32 copies of both
                a, b = a.float(), b.float()
                diff = (a - b).abs().max().item() if a.numel() else 0.0
                if not diff <= 1e-3 * (1.0 + a.abs().max().item()):
                    raise CheckpointError(f"the TP shards of {where} disagree: {name}, a copy every TP rank holds, "
                                          f"differs between tp ranks 0 and {t} (max {diff:.3g}); the shards are not "
                                          "from one model and iteration")


def _progress(src: ForeignCheckpoint, notes: list[str]) -> tuple[int, int, int]:
    """(iteration, consumed samples, applied LR steps)."""
    state = src.first
    release = src.folder.name == "release"
    iteration = 0 if release else int(state.get("iteration", state.get("total_iters", 0)) or 0)
    consumed = int(arg(state, "consumed_train_samples", 0) or 0)
    sched = state.get("opt_param_scheduler", state.get("lr_scheduler"))
    num_steps = sched.get("num_steps") if isinstance(sched, dict) else None
    gbs = arg(state, "global_batch_size")
    if not gbs and iteration and consumed and consumed % iteration == 0:
        gbs = consumed // iteration  # the reference keeps no batch size; without ramp-up this is it
    if num_steps is None or not gbs:
        if iteration:
            notes.append("the source records no global batch size for its LR position; a resumed run takes the "
                         "iteration count as the applied steps")
        return iteration, consumed, iteration
    return iteration, consumed, int(num_steps) // int(gbs)


def rng_states(state: dict[str, Any], notes: list[str]) -> list[dict[str, Any]] | None:
    """Megatron's RNG states (one per DP rank) in our form: lists for tuples, numpy's keys as ints; the CUDA
    generator's state (the reference's is the CPU one again) is not carried: devices differ."""
    per_rank = state.get("rng_state")
    per_rank = per_rank if isinstance(per_rank, list) else ([state] if "torch_rng_state" in state else [])
    out = []
    try:
        for rng in per_rank:
            version, internal, gauss = rng["random_rng_state"]
            name, keys, pos, has_gauss, cached = rng["np_rng_state"]
            torch_state = rng["torch_rng_state"]
            if not isinstance(torch_state, torch.Tensor):
                raise TypeError("torch_rng_state is not a tensor")
            out.append({"random_rng_state": [int(version), [int(k) for k in internal], gauss],
                        "np_rng_state": [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
                        "torch_rng_state": torch_state.to(torch.uint8), "cuda_rng_state": None,
                        "xla_rng_state": None})
    except (KeyError, TypeError, ValueError) as exc:
        notes.append(f"the source's RNG state was not understood ({type(exc).__name__}: {exc}); a resumed run "
                     "uses its seed")
        return None
    if not out:
        notes.append("the source holds no RNG state (--no-save-rng); a resumed run uses its seed")
        return None
    return out


def _uses_distributed_optimizer(state: dict[str, Any]) -> bool:
    """Saved with --use-distributed-optimizer (the args say so, or the optimizer entry holds settings only)."""
    opt = state.get("optimizer")
    inner = opt.get("optimizer") if isinstance(opt, dict) else None
    settings_only = isinstance(inner, dict) and "param_groups" in inner and "state" not in inner
    return "optimizer" in state and (bool(arg(state, "use_distributed_optimizer", False)) or settings_only)


def _distributed(src: ForeignCheckpoint, *, tied: bool,
                 layer_offsets: dict[tuple[int, int], int]) -> dict[tuple[int, int], foreign_optim.ForeignOptimizer]:
    """Each rank's Adam state from its distrib_optim.pt, by our names (QKV rows still the source's); empty when the
    checkpoint was not saved with the distributed optimizer. Every file's presence is checked before one is read."""
    if not _uses_distributed_optimizer(src.first):
        return {}
    files = {key: main.parent / distrib_optim.FILE for key, main in src.files.mains.items()}
    for key, path in sorted(files.items()):
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: {src.files.mains[key]} was saved with Megatron's distributed "
                                  "optimizer, which keeps Adam's state in that file; copy it from the run's save "
                                  "folder beside model_optim_rng.pt")
    bucket = arg(src.first, "ddp_bucket_size") if arg(src.first, "overlap_grad_reduce", False) else None
    if arg(src.first, "overlap_grad_reduce", False) and bucket is None:
        # megatron-core's default when --ddp-bucket-size is not given (distributed_data_parallel.py)
        bucket = max(40_000_000, 1_000_000 * int(arg(src.first, "data_parallel_size", 1) or 1))
    pp = src.files.pipeline_parallel
    out = {}
    for (p, t), path in sorted(files.items()):
        state = src.grid[p][t]
        chunks_raw = _chunks(state, where=src.files.mains[(p, t)])
        chunks = []
        for chunk in chunks_raw:
            flat = {n: w for n, w in foreign_keys.flatten(chunk).items()
                    if isinstance(w, torch.Tensor) and foreign_keys.our_name(n, family=src.family, tied=tied)}
            # A pipelined tied model keeps each stage's copy of the shared embedding in a bucket of its own.
            shared = {n for n in flat if pp > 1 and tied and n in _SHARED_EMBEDDING}
            chunks.append(distrib_optim.Chunk(params={n: w.shape for n, w in flat.items()},
                                              own_bucket=frozenset(shared)))
        per_chunk = distrib_optim.unflatten(read_rank(path), chunks, bucket_size=bucket, path=path)
        settings = state["optimizer"]
        inner = settings.get("optimizer", {}) if isinstance(settings, dict) else {}
        groups = inner.get("param_groups") or [{}]
        step = groups[0].get("step")
        moments: dict[str, foreign_optim.Moments] = {}
        masters: dict[str, torch.Tensor] = {}
        for v, named in enumerate(per_chunk):
            for name, tensors in named.items():
                ours = foreign_keys.renumber(foreign_keys.our_name(name, family=src.family, tied=tied) or name,
                                             layer_offsets[(p, v)])
                moments[ours] = {"step": step, "exp_avg": tensors["exp_avg"], "exp_avg_sq": tensors["exp_avg_sq"]}
                masters[ours] = tensors["param"]
        hyper = {k: groups[0][k] for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}
        scaler = settings.get("grad_scaler") if isinstance(settings, dict) else None
        out[(p, t)] = foreign_optim.ForeignOptimizer(moments=moments, masters=masters, hyper=hyper,
                                                     grad_scaler=scaler if isinstance(scaler, dict) else None)
    return out


_SHARED_EMBEDDING = ("embedding.word_embeddings.weight", "output_layer.weight",
                     "language_model.embedding.word_embeddings.weight", "word_embeddings_for_head.weight")


def _optimizers(src: ForeignCheckpoint, ranks: list[list[dict[str, torch.Tensor]]], *, version: float,
                heads_per_shard: int, notes: list[str],
                distributed: dict[tuple[int, int], foreign_optim.ForeignOptimizer],
                ) -> list[list[foreign_optim.ForeignOptimizer]] | None:
    """Each rank's optimizer state by our names (QKV moments and masters in our row order); None, with a note, when
    any rank's cannot be carried over."""
    out = []
    for p, row in enumerate(ranks):
        out.append([])
        for t, rank in enumerate(row):
            state = src.grid[p][t]
            if "optimizer" not in state:
                notes.append("the source holds no optimizer state (--no-save-optim); a resumed run starts Adam's "
                             "moments at zero")
                return None
            shapes = {n: w.shape for n, w in rank.items()}
            try:
                opt = distributed.get((p, t)) or foreign_optim.by_name(state["optimizer"], names=list(rank),
                                                                        shapes=shapes)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                notes.append(f"the source's optimizer state was not carried over: {exc}; a resumed run starts "
                             "Adam's moments at zero")
                return None
            for name in [n for n in opt.moments if foreign_keys.is_qkv(n)]:
                m = opt.moments[name]
                for key in ("exp_avg", "exp_avg_sq"):
                    m[key] = foreign_keys.qkv_to_ours(m[key], version=version, heads=heads_per_shard)
            for name in [n for n in opt.masters if foreign_keys.is_qkv(n)]:
                opt.masters[name] = foreign_keys.qkv_to_ours(opt.masters[name], version=version,
                                                             heads=heads_per_shard)
            out[-1].append(opt)
    return out


def adamw_defaults() -> dict[str, Any]:
    """The settings of a param group of torch's AdamW as its state_dict has them, read from its signature: making
    one (the obvious way) imports torch._dynamo, 1-5 s of every `ckpt convert` (benchmarks/RESULTS.md, issue 27)."""
    import inspect

    group = {name: p.default for name, p in inspect.signature(torch.optim.AdamW.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}
    if "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters:
        group["decoupled_weight_decay"] = True  # what AdamW passes to Adam
    return group


def adam_groups(hyper: dict[str, Any]) -> list[dict[str, Any]]:
    """Our trainer's two AdamW groups (weight decay, then none) with the source's settings."""
    decay = {**adamw_defaults(), **hyper}
    decay["betas"] = tuple(decay["betas"])
    return [decay, {**decay, "weight_decay": 0.0}]


def _our_optimizer(opt: foreign_optim.ForeignOptimizer, model: dict[str, torch.Tensor],
                   lr_steps: int) -> dict[str, Any]:
    moments = {}
    for name, m in opt.moments.items():
        step = m["step"] if m["step"] is not None else lr_steps
        step = float(step.item() if isinstance(step, torch.Tensor) else step)
        moments[name] = {"step": torch.tensor(step, dtype=torch.float32), "exp_avg": m["exp_avg"].float().contiguous(),
                         "exp_avg_sq": m["exp_avg_sq"].float().contiguous()}
    return optim_layout.indexed(moments, model=model, groups=adam_groups(opt.hyper))


def import_foreign(src: ForeignCheckpoint, *, vocab_size: int | None = None, lazy: bool = False) -> Imported:
    """`src` as our WholeCheckpoint at its own TP x PP (in memory), with notes on what was not carried over.

    Consumes `src`'s model weights (its states lose their `model` keys). Each weight keeps the precision the source
    holds it at: its fp32 master where the source's optimizer has one, else its own dtype (a bf16 weights-only save
    stays bf16: an fp32 copy would add no information and double the bytes written; the trainer's load casts it into
    its parameters). `lazy`: the whole's model dicts hold meta tensors of those dtypes instead, and the result's
    `source` fetches each weight from `src`'s tensors when stream.reshard needs it (read `src` with mmap for that to
    save memory)."""
    where = src.files.mains[(0, 0)]
    if src.family == OURS:
        raise CheckpointError(f"{src.folder} holds megatron-hpc shards but no manifest.json: a copy that lost it or "
                              "a damaged folder; copy the checkpoint again, or pass an earlier iteration")
    notes: list[str] = []
    state = src.first
    for p, row in enumerate(src.grid):
        for t, s in enumerate(row):
            for key in ("iteration", "checkpoint_version"):
                if s.get(key) != state.get(key):
                    raise CheckpointError(f"the TP x PP shards of {src.folder} disagree: {src.files.mains[(p, t)]} "
                                          f"has {key} {s.get(key)!r}, {where} {state.get(key)!r}; they are not one "
                                          "checkpoint")
    megatron_args.check_architecture(state, where=where)
    version, heads = _check_sizes(src, where=where)
    tp, pp = src.files.tensor_parallel, src.files.pipeline_parallel
    untied = bool(arg(state, "untie_embeddings_and_output_weights", False))
    tied = not untied and not (pp == 1 and _has_output_layer(state))
    ranks, layer_offsets = _renamed(src, tied=tied)
    iteration, consumed, lr_steps = _progress(src, notes)
    optimizers = _optimizers(src, ranks, version=version, heads_per_shard=heads // tp, notes=notes,
                             distributed=_distributed(src, tied=tied, layer_offsets=layer_offsets))
    if arg(state, "swiglu", False):
        _split_swiglu(ranks, optimizers, where=src.folder)
    _drop_models(src)  # the weights live on in `ranks` alone, so each is freed once it is ours
    source = None
    if lazy:
        models, weight, release = _lazy_models(src, ranks, optimizers, version=version, heads_per_shard=heads // tp)
        full = stream.merged_shapes(models, weight)  # the tied copies compared by value, the rest by shape
    else:
        models = _our_models(src, ranks, optimizers, version=version, heads_per_shard=heads // tp)
        full = pp_layout.merged_shapes(models)  # shapes only: a merged copy would hold the model twice
    cfg = megatron_args.model_config(state, full, where=src.folder, vocab_size=vocab_size, notes=notes)
    _check_layers(full, cfg, where=src.folder)
    rng = rng_states(state, notes)
    scaler = optimizers[0][0].grad_scaler if optimizers else None
    grid = []
    for p, row in enumerate(models):
        grid.append([])
        for t, model in enumerate(row):
            ordered = {n: model[n] for n in pp_layout.model_order(model)}
            s = _state(src, cfg, ordered, iteration=iteration, consumed=consumed, lr_steps=lr_steps, rng=rng,
                       scaler=scaler, version=version, padded=full["wte.weight"].shape[0])
            if optimizers:
                s["optimizer"] = _our_optimizer(optimizers[p][t], ordered, lr_steps)
            grid[-1].append(s)
    manifest = Manifest(iteration=iteration, format=src.files.format, tensor_parallel=tp, pipeline_parallel=pp,
                        data_parallel=1, world_size=tp * pp)
    whole = WholeCheckpoint(found=FoundCheckpoint(folder=src.folder, manifest=manifest), grid=grid)
    if lazy:
        source = stream.Source(whole=whole, weight=weight, release=release)
    return Imported(whole=whole, family=src.family, notes=list(dict.fromkeys(notes)), source=source)


def _check_sizes(src: ForeignCheckpoint, *, where: object) -> tuple[float, int]:
    """(checkpoint version, heads): the shard grid, heads and query groups fit the arguments."""
    state = src.first
    tp, pp = src.files.tensor_parallel, src.files.pipeline_parallel
    recorded = (arg(state, "tensor_model_parallel_size", arg(state, "model_parallel_size")),
                arg(state, "pipeline_model_parallel_size", 1))
    if None not in recorded and (int(recorded[0]), int(recorded[1])) != (tp, pp):
        raise CheckpointError(f"{src.folder} holds tp {tp} x pp {pp} shards but its arguments say tp {recorded[0]} x "
                              f"pp {recorded[1]}; shards are missing, copy them or pass another iteration")
    version = float(state.get("checkpoint_version", 0) or 0)
    heads = arg(state, "num_attention_heads")
    if not isinstance(heads, int) or heads % tp:
        raise CheckpointError(f"{where} records num_attention_heads={heads!r}, which tp {tp} does not divide; the "
                              "checkpoint's arguments do not fit its shards")
    groups = megatron_args.query_groups(state)
    if groups != heads and groups % tp:
        raise CheckpointError(f"{where} records {groups} query groups for {heads} heads, which tp {tp} does not "
                              "divide: Megatron splits whole groups over TP; the checkpoint's arguments do not fit "
                              "its shards")
    if groups != heads and version < 2.0:
        raise CheckpointError(f"{where} records {groups} query groups for {heads} heads in checkpoint_version "
                              f"{version}, whose per-head QKV row orders predate grouped-query attention; the "
                              "checkpoint's arguments do not fit its version")
    return version, heads


def _split_swiglu(ranks: list[list[dict[str, torch.Tensor]]],
                  optimizers: list[list[foreign_optim.ForeignOptimizer]] | None, *, where: object) -> None:
    """SwiGLU's fused fc (Megatron's linear_fc1 / dense_h_to_4h: [gate_r; up_r] rows on TP rank r, its glu chunks
    the rank's output in two) as our mlp.gate and mlp.fc, in the weights, masters and moments, in place and in
    order. Views: nothing is copied."""
    def halves(name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if t.shape[0] % 2:
            raise CheckpointError(f"{where}: {name} has {t.shape[0]} rows on one TP rank, not [gate; up] halves; "
                                  "the checkpoint's swiglu argument does not fit its weights")
        gate, up = t.chunk(2, dim=0)
        return gate, up

    def moment_halves(name: str, m: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        (g1, u1), (g2, u2) = halves(name, m["exp_avg"]), halves(name, m["exp_avg_sq"])
        return {**m, "exp_avg": g1, "exp_avg_sq": g2}, {**m, "exp_avg": u1, "exp_avg_sq": u2}

    def split(named: dict[str, Any], cut: Callable[[str, Any], tuple[Any, Any]]) -> None:
        items = list(named.items())
        named.clear()
        for name, value in items:
            if name.endswith((".mlp.fc.weight", ".mlp.fc.bias")):
                named[name.replace(".mlp.fc.", ".mlp.gate.")], named[name] = cut(name, value)
            else:
                named[name] = value

    for p, row in enumerate(ranks):
        for t, rank in enumerate(row):
            split(rank, halves)
            if optimizers:
                split(optimizers[p][t].masters, halves)
                split(optimizers[p][t].moments, moment_halves)


def _check_layers(full: dict[str, torch.Tensor], cfg: dict[str, Any], *, where: object) -> None:
    """Every layer holds exactly the weights our GPT has for `cfg` (its norms, biases and MLP)."""
    want = megatron_args.layer_keys(cfg)
    for i in range(cfg["num_layers"]):
        got = sorted(n[len(f"h.{i}."):] for n in full if foreign_keys.layer_of(n) == i)
        if got != want:
            odd = sorted(set(got) ^ set(want))[:3]
            raise CheckpointError(f"{where}: layer {i} holds {got} but our GPT with the checkpoint's arguments "
                                  f"(normalization, swiglu, biases) has {want} (differing: {odd}); it cannot be "
                                  "converted")


def _our_models(src: ForeignCheckpoint, ranks: list[list[dict[str, torch.Tensor]]],
                 optimizers: list[list[foreign_optim.ForeignOptimizer]] | None, *, version: float,
                 heads_per_shard: int) -> list[list[dict[str, torch.Tensor]]]:
    """Every rank's weights (the fp32 masters where kept, else the source's own), QKV rows in our order; `ranks` is
    emptied."""
    models: list[list[dict[str, torch.Tensor]]] = []
    for p, row in enumerate(ranks):
        models.append([])
        for t, rank in enumerate(row):
            masters = optimizers[p][t].masters if optimizers else {}
            model = {}
            for name in list(rank):
                w = rank.pop(name)
                w = masters.get(name, foreign_keys.qkv_to_ours(w, version=version, heads=heads_per_shard)
                                if foreign_keys.is_qkv(name) else w)
                model[name] = w.detach().contiguous()
                del w
            models[-1].append(model)
        _check_tp_agree(models[-1], where=src.folder)
    give_back_freed()  # the source's copies, freed one by one above
    return models


def _lazy_models(src: ForeignCheckpoint, ranks: list[list[dict[str, torch.Tensor]]],
                 optimizers: list[list[foreign_optim.ForeignOptimizer]] | None, *, version: float,
                 heads_per_shard: int) -> tuple[list[list[dict[str, torch.Tensor]]], stream.Fetch,
                                                Callable[[int, int, str], None]]:
    """_our_models as meta tensors, and how to fetch and let go of each weight's values: the source's tensor (or its
    master), QKV rows put in our order when fetched."""
    table: dict[tuple[int, int], dict[str, tuple[torch.Tensor, bool]]] = {}
    models: list[list[dict[str, torch.Tensor]]] = []

    def weight(p: int, t: int, name: str) -> torch.Tensor:
        w, qkv = table[(p, t)][name]
        return foreign_keys.qkv_to_ours(w, version=version, heads=heads_per_shard) if qkv else w

    def release(p: int, t: int, name: str) -> None:
        table[(p, t)].pop(name, None)

    for p, row in enumerate(ranks):
        models.append([])
        for t, rank in enumerate(row):
            masters = optimizers[p][t].masters if optimizers else {}
            mine, model = table.setdefault((p, t), {}), {}
            for name in list(rank):
                w = rank.pop(name)
                kept = name in masters
                mine[name] = (masters[name] if kept else w.detach(), foreign_keys.is_qkv(name) and not kept)
                model[name] = torch.empty(mine[name][0].shape, dtype=mine[name][0].dtype, device="meta")
            models[-1].append(model)
        _check_tp_agree(models[-1], where=src.folder, value=lambda t, name, p=p: weight(p, t, name))
    return models, weight, release


def _drop_models(src: ForeignCheckpoint) -> None:
    """Let go of the source's nested model dicts (everything else in its states is still read)."""
    for row in src.grid:
        for state in row:
            for key in [k for k in state if isinstance(k, str) and (k == "model" or k[5:].isdigit())
                        and k[:5] == "model"]:
                del state[key]


def _has_output_layer(state: dict[str, Any]) -> bool:
    return any("output_layer" in name for chunk in _chunks(state, where="") for name in foreign_keys.flatten(chunk))


def _state(src: ForeignCheckpoint, cfg: dict[str, Any], model: dict[str, torch.Tensor], *, iteration: int,
           consumed: int, lr_steps: int, rng: list[dict[str, Any]] | None, scaler: dict[str, Any] | None,
           version: float, padded: int) -> dict[str, Any]:
    """One rank's state in our checkpoint's keys (checkpoint/store/contents.py)."""
    first = src.first
    out: dict[str, Any] = {
        "num_layers": cfg["num_layers"], "hidden_size": cfg["hidden_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "tensor_model_parallel_size": src.files.tensor_parallel,
        "pipeline_model_parallel_size": src.files.pipeline_parallel,
        "consumed_train_samples": consumed, "consumed_valid_samples": int(arg(first, "consumed_valid_samples", 0) or 0),
        "max_position_embeddings": cfg["max_position_embeddings"],
        "make_vocab_size_divisible_by": cfg["make_vocab_size_divisible_by"],
        "padded_vocab_size": padded,
        "tokenizer_type": arg(first, "tokenizer_type"), "checkpoint_version": 3.0, "iteration": iteration,
        "model": model,
        "lr_scheduler": {"successful_steps": lr_steps},
        "resolved_config": {"model": cfg, "data": _data_config(first)},
        "converted_from": {"family": src.family, "folder": str(src.folder), "format": src.files.format,
                           "tensor_parallel": src.files.tensor_parallel,
                           "pipeline_parallel": src.files.pipeline_parallel, "checkpoint_version": version,
                           "iteration": iteration},
    }
    if rng is not None:
        out.update(rng[0])
        out["rng_state"] = rng
    if scaler is not None and {"scale", "growth_tracker", "hysteresis_tracker"} <= set(scaler):
        out["grad_scaler"] = {"scale": float(scaler["scale"]), "growth_tracker": int(scaler["growth_tracker"]),
                              "hysteresis_tracker": int(scaler["hysteresis_tracker"])}
    return out


def _data_config(state: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer the source run named (for `ckpt convert --to hf`), when it says."""
    out = {k: arg(state, k) for k in ("tokenizer_type", "vocab_file", "merge_file") if arg(state, k) is not None}
    return {k: v for k, v in out.items() if isinstance(v, str)}

