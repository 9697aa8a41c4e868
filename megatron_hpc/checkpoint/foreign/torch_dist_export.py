"""Our checkpoint as a megatron-core torch_dist folder that Megatron-LM loads with `--ckpt-format torch_dist --load`
and continues: `ckpt convert SRC --to torch_dist [--tp N --pp M] [--distributed-optimizer]`.

What is written (the layout torch_dist_files.py reads; the state dict Megatron-LM's generate_state_dict makes, read
in megatron/training/checkpointing.py):

- the data through torch.distributed.checkpoint's own writer (one process), a part at a time (torch_dist_write.py:
  one decoder layer's slice of every stacked key, or one other key, each with its Adam state; with a streamed
  source, read a part at a time too): each model key's global tensor (torch_dist_keys.to_megatron: layers stacked,
  one chunk per layer as megatron-core saves them, fused norm names, SwiGLU [gate; up]), the word embeddings and an
  untied output layer padded for tp N as Megatron pads them, and Adam's state in model space;
- common.pt: args (the model's and the run's settings under Megatron-LM's argument names, the sizes tp N x pp M,
  no_save_rng: our RNG streams are not megatron-core's), iteration, checkpoint_version 3.0, the scheduler
  (opt_param_scheduler: Megatron-LM's get_optimizer_param_scheduler of our optim and train settings, num_steps =
  applied steps x global batch), the optimizer's param groups and step, content_metadata;
- the `_extra_state` objects of the layers' linear modules (empty), which megatron-core's models ask for;
- metadata.json last, then the tracker.

The optimizer takes the form the loading run's optimizer asks for (megatron-core 0.16.1 optimizer.py,
distrib_optimizer.py): plain Adam (FP32Optimizer, or Float16Optimizer with fp32_param masters: both are written)
by default; with `distributed`, the distributed optimizer's fully_reshardable form, which it loads at any TP, PP
and DP. Without Adam's state or the LR settings (a Hugging Face import, a legacy Megatron import) the folder holds
the weights only and its args say no_save_optim: Megatron-LM then starts the optimizer afresh (use --finetune).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.atomic_write import write_text_atomic
from megatron_hpc.checkpoint.conversion import (
    WholeCheckpoint,
    model_config,
    optim_layout,
    pp_layout,
    stream,
    tp_layout,
)
from megatron_hpc.checkpoint.foreign import torch_dist_keys
from megatron_hpc.checkpoint.foreign.torch_dist_files import BACKEND, COMMON, CONFIG
from megatron_hpc.checkpoint.foreign.torch_dist_write import Box, PartWriter
from megatron_hpc.checkpoint.store import paths, staged_iteration
from megatron_hpc.errors import CheckpointError
from megatron_hpc.plan.vocab import padded_vocab_size

_GROUP = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0, "is_decoupled_lr": False,
          "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
          "fused": None, "decoupled_weight_decay": True}
"""megatron-core's Adam param group keys besides the ones set here (wd_mult, lr_mult, is_expert_parallel and
is_decoupled_lr are how it matches a loaded group to its own)."""
_OUR_LAYER = re.compile(r"^h\.(\d+)\.(.+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Exported:
    folder: Path
    optimizer: str
    """adam, distributed (fully_reshardable) or none (weights only)."""
    notes: list[str]


def _merged(whole: WholeCheckpoint, *, num_layers: int) -> tuple[dict[str, torch.Tensor],
                                                                 dict[str, dict[str, Any]] | None]:
    """The whole model, and each parameter's whole Adam state (None when a rank has none)."""
    grid = [[s["model"] for s in row] for row in whole.grid]
    model = pp_layout.merge_grid(grid, num_layers=num_layers)
    if not all("optimizer" in s for row in whole.grid for s in row):
        return model, None
    per_tp: list[dict[str, dict[str, Any]]] = []
    for t in range(whole.tensor_parallel):
        merged: dict[str, dict[str, Any]] = {}
        for row in whole.grid:
            for name, moments in optim_layout.by_name(row[t]["model"], row[t]["optimizer"]).items():
                merged.setdefault(name, moments)
        per_tp.append(merged)
    moments = {}
    for name in model:
        if not all(name in m for m in per_tp):
            return model, None
        moments[name] = {"step": per_tp[0][name]["step"],
                         **{k: tp_layout.merge(name, [m[name][k] for m in per_tp]) for k in ("exp_avg", "exp_avg_sq")}}
    return model, moments


def _schedule(config: dict[str, Any], lr_steps: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(opt_param_scheduler, the args it comes from) as Megatron-LM's get_optimizer_param_scheduler builds them,
    None without the settings."""
    optim, train = config.get("optim"), config.get("train")
    if not isinstance(optim, dict) or not isinstance(train, dict) or "lr" not in optim:
        return None
    gbs, iters = int(train.get("global_batch_size", 0) or 0), int(train.get("num_steps", 0) or 0)
    if not gbs or not iters:
        return None
    decay_iters = optim.get("lr_decay_iters") or iters
    decay = int(optim.get("lr_decay_samples") or decay_iters * gbs)
    if optim.get("lr_warmup_fraction") is not None:
        warmup = float(optim["lr_warmup_fraction"]) * decay
    else:
        warmup = int(optim.get("lr_warmup_samples") or int(optim.get("lr_warmup_iters", 0) or 0) * gbs)
    wd = float(optim.get("weight_decay", 0.01))
    sched = {"max_lr": float(optim["lr"]), "lr_warmup_steps": warmup, "num_steps": lr_steps * gbs,
             "lr_decay_style": optim.get("lr_decay_style", "cosine"), "lr_decay_steps": decay,
             "min_lr": float(optim.get("min_lr", 0.0)), "start_wd": wd, "end_wd": wd, "wd_incr_style": "constant",
             "wd_incr_steps": iters * gbs}
    args = {"lr": sched["max_lr"], "min_lr": sched["min_lr"], "lr_decay_style": sched["lr_decay_style"],
            "lr_decay_iters": decay_iters, "lr_warmup_iters": int(optim.get("lr_warmup_iters", 0) or 0),
            "lr_warmup_fraction": optim.get("lr_warmup_fraction"), "weight_decay": wd,
            "start_weight_decay": wd, "end_weight_decay": wd, "weight_decay_incr_style": "constant",
            "adam_beta1": float(optim.get("adam_beta1", 0.9)), "adam_beta2": float(optim.get("adam_beta2", 0.999)),
            "adam_eps": float(optim.get("adam_eps", 1e-8)), "clip_grad": float(optim.get("clip_grad", 1.0)),
            "global_batch_size": gbs, "micro_batch_size": int(train.get("micro_batch_size", 1) or 1),
            "train_iters": iters}
    return sched, args


def _args(cfg: dict[str, Any], *, tp: int, pp: int, padded: int, state: dict[str, Any], train: dict[str, Any],
          optimizer: str) -> argparse.Namespace:
    """Megatron-LM's args for the model and run (its argument names; what load_args_from_checkpoint reads)."""
    heads, groups = cfg["num_attention_heads"], cfg.get("num_query_groups")
    rope = cfg.get("position_embedding", "learned") == "rope"
    data = (state.get("resolved_config") or {}).get("data") or {}
    return argparse.Namespace(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg.get("ffn_hidden_size") or 4 * cfg["hidden_size"], num_attention_heads=heads,
        group_query_attention=groups is not None, num_query_groups=groups or heads,
        kv_channels=cfg["hidden_size"] // heads, seq_length=cfg["seq_length"],
        max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
        padded_vocab_size=padded, make_vocab_size_divisible_by=cfg.get("make_vocab_size_divisible_by", 128),
        position_embedding_type="rope" if rope else "learned_absolute", add_position_embedding=not rope,
        use_rotary_position_embeddings=rope, rotary_base=int(cfg.get("rotary_base", 10000)),
        rotary_percent=cfg.get("rotary_percent", 1.0), rotary_interleaved=False,
        use_rope_scaling=cfg.get("rope_scaling", "none") == "llama3",
        rope_scaling_factor=cfg.get("rope_scaling_factor", 8.0),
        normalization="RMSNorm" if cfg.get("normalization") == "rmsnorm" else "LayerNorm",
        norm_epsilon=cfg.get("layernorm_epsilon", 1e-5), swiglu=bool(cfg.get("swiglu", False)),
        add_bias_linear=cfg.get("add_bias_linear", True), add_qkv_bias=cfg.get("add_qkv_bias", False),
        untie_embeddings_and_output_weights=not cfg.get("tie_embeddings", True),
        openai_gelu=cfg.get("activation") == "gelu_tanh", bias_gelu_fusion=False,
        init_method_std=cfg.get("init_method_std", 0.02), hidden_dropout=cfg.get("hidden_dropout", 0.0),
        attention_dropout=cfg.get("attention_dropout", 0.0),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, ckpt_format="torch_dist",
        use_distributed_optimizer=optimizer == "distributed",
        dist_ckpt_optim_fully_reshardable=optimizer == "distributed", no_save_optim=optimizer == "none",
        no_save_rng=True,
        consumed_train_samples=int(state.get("consumed_train_samples", 0) or 0),
        consumed_valid_samples=int(state.get("consumed_valid_samples", 0) or 0),
        tokenizer_type=state.get("tokenizer_type") or data.get("tokenizer_type"),
        vocab_file=data.get("vocab_file"), merge_file=data.get("merge_file"), bf16=False, fp16=False, **train)


def _groups(args: dict[str, Any], *, step: float | None) -> list[dict[str, Any]]:
    """megatron-core's two Adam param groups (weight decay, then none), as its optimizer state_dict holds them."""
    out = []
    for wd_mult in (1.0, 0.0):
        group = {**_GROUP, "wd_mult": wd_mult, "max_lr": args["lr"], "min_lr": args["min_lr"], "lr": args["lr"],
                 "betas": (args["adam_beta1"], args["adam_beta2"]), "eps": args["adam_eps"],
                 "weight_decay": args["weight_decay"] * wd_mult}
        if step is not None:
            group["step"] = step
        out.append(group)
    return out


def _repad(model: dict[str, torch.Tensor], *, vocab: int, padded: int) -> dict[str, torch.Tensor]:
    return {n: tp_layout.repad_vocab(t, vocab_size=vocab, padded=padded) if n in ("wte.weight", "lm_head.weight")
            else t for n, t in model.items()}


def export_torch_dist(whole: WholeCheckpoint, out: Path, *, tp: int, pp: int, distributed: bool = False,
                      source: stream.Source | None = None) -> Exported:
    """Write `whole` into `out` as a torch_dist checkpoint for a megatron-core run at tp x pp (any DP).

    With `source` (a stream.Source over `whole` at TP 1 x PP 1 whose tensors are meta, as import_torch_dist's
    streamed read gives), the data are fetched and written a part at a time (a decoder layer, or one other
    weight, with its Adam state) and each part is released once written, so the convert holds about one part."""
    cfg = model_config(whole)
    state = whole.first
    if paths.iteration_dir(out, whole.iteration).exists():
        raise CheckpointError(f"{paths.iteration_dir(out, whole.iteration)} already exists; pass another --out folder")
    heads, groups = cfg["num_attention_heads"], cfg.get("num_query_groups") or cfg["num_attention_heads"]
    if tp < 1 or pp < 1 or heads % tp or groups % tp or cfg["num_layers"] % pp:
        raise CheckpointError(f"tp {tp} x pp {pp} does not fit the model ({heads} heads, {groups} query groups, "
                              f"{cfg['num_layers']} layers): pick a TP size dividing both and a PP size dividing the "
                              "layers")
    if source is not None and (whole.tensor_parallel, whole.pipeline_parallel) != (1, 1):
        raise CheckpointError("a streamed torch_dist export takes a source read at TP 1 x PP 1")  # callers' bug
    notes: list[str] = []
    padded = padded_vocab_size(cfg["vocab_size"], divisible_by=cfg.get("make_vocab_size_divisible_by", 128),
                               tensor_parallel=tp)
    model, moments = _merged(whole, num_layers=cfg["num_layers"])
    lr_steps = int((state.get("lr_scheduler") or {}).get("successful_steps", whole.iteration))
    schedule = _schedule(state.get("resolved_config") or {}, lr_steps)
    kind = "distributed" if distributed else "adam"
    if moments is None or schedule is None:
        why = "holds no Adam state" if moments is None else "records no LR schedule (optim and train settings)"
        notes.append(f"the checkpoint {why}; the torch_dist folder holds the weights only (args no_save_optim): "
                     "load it with Megatron-LM's --finetune or --no-load-optim")
        kind = "none"
    common: dict[str, Any] = {"checkpoint_version": 3.0, "iteration": whole.iteration,
                              "num_floating_point_operations_so_far": 0}
    train_args: dict[str, Any] = {}
    if kind != "none":
        assert moments is not None and schedule is not None  # kind says so
        sched, train_args = schedule
        step = float(next(iter(moments.values()))["step"])
        groups_ = _groups(train_args, step=step if distributed else None)
        if distributed:
            common["optimizer"] = {"optimizer": {"param_groups": groups_},
                                   "param_state_sharding_type": "fully_reshardable"}
        else:
            # Both of megatron-core's plain layouts (optimizer.py state_dict, 0.16.1): FP32Optimizer's (torch's state
            # dict at the top) for an fp32 run, and Float16OptimizerWithFloat16Params' (nested under 'optimizer',
            # the masters from optimizer.state.fp32_param) for --bf16 / --fp16, which refused the top-level one
            # (KeyError 'pre_wd_mult'). Each reads its own and ignores the other.
            plain = {"state": {"common_step": torch.tensor(step)}, "param_groups": groups_}
            common["optimizer"] = {**plain, "optimizer": {"state": {"common_step": torch.tensor(step)},
                                                          "param_groups": [dict(g) for g in groups_]}}
        common["opt_param_scheduler"] = sched
    common["args"] = _args(cfg, tp=tp, pp=pp, padded=padded, state=state, train=train_args, optimizer=kind)
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed and kind != "none":
        content.update(distrib_optim_sharding_type="fully_reshardable",
                       distrib_optim_fully_reshardable_mem_efficient=False)
    common["content_metadata"] = content
    fetch = _Fetch.of(model, moments, source)
    parts = _parts(model, fetch, adam=None if kind == "none" else "param" if distributed else "fp32_param",
                   tied=cfg.get("tie_embeddings", True), vocab=cfg["vocab_size"], padded=padded,
                   num_layers=cfg["num_layers"])
    folder = _write(out, whole.iteration, parts, _extra_states(cfg["num_layers"]), common)
    return Exported(folder=folder, optimizer=kind, notes=notes)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Fetch:
    """Our whole model's values by name: from the merged dicts, or fetched from a streamed source."""

    weight: Callable[[str], torch.Tensor]
    moment: Callable[[str, str], torch.Tensor]
    release: Callable[[str], None]

    @staticmethod
    def of(model: dict[str, torch.Tensor], moments: dict[str, dict[str, Any]] | None,
           source: stream.Source | None) -> _Fetch:
        if source is None:
            return _Fetch(weight=model.__getitem__, moment=lambda n, what: moments[n][what],  # type: ignore[index]
                          release=lambda n: None)
        if source.moment is None:  # the whole's optimizer dicts hold the values
            return _Fetch(weight=lambda n: source.weight(0, 0, n),
                          moment=lambda n, what: moments[n][what],  # type: ignore[index]
                          release=lambda n: source.release(0, 0, n))
        fetch_moment = source.moment
        return _Fetch(weight=lambda n: source.weight(0, 0, n), moment=lambda n, what: fetch_moment(0, 0, n, what),
                      release=lambda n: source.release(0, 0, n))


def _parts(model: dict[str, torch.Tensor], fetch: _Fetch, *, adam: str | None, tied: bool, vocab: int, padded: int,
           num_layers: int) -> Iterator[dict[str, tuple[torch.Tensor, Box | None]]]:
    """megatron-core's tensors a part at a time, each with its box in the global tensor: one decoder layer's slice
    of every stacked key (built as layer 0 by to_megatron, placed at layer N), or one other weight; with `adam`
    (the master's key: fp32_param, or param for the distributed optimizer), Adam's state beside each. A part's
    names are released once it has been handed on (written)."""
    units: dict[int | str, list[str]] = {}
    for name in model:
        match = _OUR_LAYER.match(name)
        units.setdefault(int(match.group(1)) if match else name, []).append(name)
    for unit, names in units.items():
        layer = unit if isinstance(unit, int) else None
        local = {(_OUR_LAYER.sub(r"h.0.\2", n) if layer is not None else n): n for n in names}
        weights = _repad({ln: fetch.weight(n) for ln, n in local.items()}, vocab=vocab, padded=padded)
        tensors = torch_dist_keys.to_megatron(weights, tied=tied)
        if adam is not None:
            moments = {ln: {what: fetch.moment(n, what) for what in ("exp_avg", "exp_avg_sq")}
                       for ln, n in local.items()}
            tensors.update(_optimizer_tensors(moments, model=weights, tied=tied, vocab=vocab, padded=padded,
                                              fp32_key=adam))
        part = {key: (t, None if layer is None else ((layer,) + (0,) * (t.ndim - 1),
                                                     torch.Size((num_layers, *t.shape[1:]))))
                for key, t in tensors.items()}
        del weights, tensors
        yield part
        del part  # written: not held while the next part is made
        for name in names:
            fetch.release(name)


def _extra_states(num_layers: int) -> dict[str, list[None]]:
    """The `_extra_state` ShardedObject of each layer's linear modules, which a megatron-core model asks for on load:
    [None] (the shard list of an empty extra state) under `<module>._extra_state/shard_<layer>_<layers>`, as its
    local spec saves them (Transformer Engine's modules take None as no FP8 state)."""
    modules = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
    return {f"decoder.layers.{m}._extra_state/shard_{i}_{num_layers}": [None] for m in modules
            for i in range(num_layers)}


def _optimizer_tensors(moments: dict[str, dict[str, Any]], *, model: dict[str, torch.Tensor], tied: bool, vocab: int,
                       padded: int, fp32_key: str) -> dict[str, torch.Tensor]:
    """optimizer.state.{exp_avg, exp_avg_sq, <fp32_key>}.<model key>, whole."""
    out: dict[str, torch.Tensor] = {}
    parts = {"exp_avg": {n: m["exp_avg"].float() for n, m in moments.items()},
             "exp_avg_sq": {n: m["exp_avg_sq"].float() for n, m in moments.items()},
             fp32_key: {n: w.float() for n, w in model.items()}}
    for what, named in parts.items():
        for key, tensor in torch_dist_keys.to_megatron(_repad(named, vocab=vocab, padded=padded), tied=tied).items():
            out[f"optimizer.state.{what}.{key}"] = tensor
    return out


def _write(out: Path, iteration: int, parts: Iterable[dict[str, tuple[torch.Tensor, Box | None]]],
           objects: dict[str, Any], common: dict[str, Any]) -> Path:
    """The iteration folder through a temporary one, a part at a time (torch_dist_write.py), metadata.json last as
    megatron-core writes it, then the tracker."""
    final = paths.iteration_dir(out, iteration)
    with staged_iteration(out, iteration) as tmp:
        writer = PartWriter(tmp)
        for part in parts:
            writer.write(part)
            del part  # the part's tensors go before the next is made
        writer.write(objects)
        writer.finish()
        torch.save(common, tmp / COMMON)
        (tmp / CONFIG).write_text(json.dumps(BACKEND), encoding="utf-8")
        tmp.rename(final)
    write_text_atomic(paths.tracker_file(out), str(iteration), durable=True)
    return final
