"""A megatron-core torch_dist checkpoint as ours: `ckpt inspect` of it, and `ckpt convert` into our layout.

The folder is read through torch.distributed.checkpoint (torch_dist_files.py): each key's global tensor, so the TP x
PP x DP it was saved at does not matter; whole, or for `ckpt convert --to torch|xser|hf` a unit at a time as
stream.reshard or the Hugging Face export asks for it (torch_dist_stream.py). Its keys become our names
(torch_dist_keys.py), the model config comes from the saved `args` (Megatron-LM's argument names) checked against
the tensors, Adam's state from whichever layout the optimizer saved (torch_dist_optim.py), progress from iteration,
consumed samples and the scheduler's num_steps (samples: applied steps = num_steps / global batch), and the RNG
from the (pp 0, tp 0) rng_state object.
The result is one rank (TP 1 x PP 1) of our checkpoint that stream.reshard writes at any TP x PP; `saved` says what
the source was saved at, the default the CLI keeps.

The learning-rate settings (Megatron-LM's args) go into the resolved config's optim and train sections, so a
checkpoint converted back to torch_dist (torch_dist_export.py) carries the scheduler megatron-core checks on load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.conversion import WholeCheckpoint, optim_layout, pp_layout, stream
from megatron_hpc.checkpoint.foreign import megatron_args, torch_dist_keys, torch_dist_optim
from megatron_hpc.checkpoint.foreign.importer import Imported, adam_groups, rng_states
from megatron_hpc.checkpoint.foreign.megatron_family import arg
from megatron_hpc.checkpoint.foreign.torch_dist_buckets import BucketSpace, bucket_space
from megatron_hpc.checkpoint.foreign.torch_dist_files import TorchDistFolder, open_folder, read
from megatron_hpc.checkpoint.foreign.torch_dist_stream import Slot, StreamedReader, slots
from megatron_hpc.checkpoint.store import FoundCheckpoint, Manifest
from megatron_hpc.errors import CheckpointError

FAMILY = "megatron-core"


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchDistImport:
    imported: Imported
    saved: tuple[int, int, int]
    """(tp, pp, dp) the source was saved at, from its args."""
    reader: StreamedReader | None = None
    """With import_torch_dist(stream_budget=...): what reads the source for the result's `source` (its peak_bytes)."""


def _args(src: TorchDistFolder) -> Any:
    args = src.common.get("args")
    if args is None or not hasattr(args, "num_attention_heads"):
        raise CheckpointError(f"{src.folder}/common.pt has no Megatron-LM args (num_attention_heads, ...); the model "
                              "cannot be rebuilt without them, save it with Megatron-LM's training loop")
    return args


def _num_layers(src: TorchDistFolder, model_keys: list[str], args: Any) -> int:
    stacked = {src.keys[k].size[0] for k in model_keys if torch_dist_keys.layer_slots(k) is not None}
    recorded = getattr(args, "num_layers", None)
    if len(stacked) != 1 or (recorded is not None and stacked != {recorded}):
        raise CheckpointError(f"{src.folder}: its decoder.layers tensors stack {sorted(stacked)} layers but its args "
                              f"say num_layers={recorded}; the checkpoint is not one model, pass another iteration")
    return stacked.pop()


def _train_settings(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our optim and train sections from Megatron-LM's args (the keys it has)."""
    optim = {ours: getattr(args, name) for ours, name in (
        ("lr", "lr"), ("min_lr", "min_lr"), ("weight_decay", "weight_decay"), ("adam_beta1", "adam_beta1"),
        ("adam_beta2", "adam_beta2"), ("adam_eps", "adam_eps"), ("clip_grad", "clip_grad"),
        ("lr_decay_style", "lr_decay_style"), ("lr_warmup_iters", "lr_warmup_iters"),
        ("lr_decay_iters", "lr_decay_iters")) if getattr(args, name, None) is not None}
    train = {ours: getattr(args, name) for ours, name in (
        ("global_batch_size", "global_batch_size"), ("micro_batch_size", "micro_batch_size"),
        ("num_steps", "train_iters")) if getattr(args, name, None) is not None}
    return optim, train


def _progress(src: TorchDistFolder, args: Any, notes: list[str]) -> tuple[int, int, int]:
    """(iteration, consumed samples, applied LR steps)."""
    iteration = 0 if src.folder.name == "release" else int(src.common.get("iteration", 0) or 0)
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0)
    sched = src.common.get("opt_param_scheduler")
    gbs = getattr(args, "global_batch_size", None)
    if not isinstance(sched, dict) or sched.get("num_steps") is None or not gbs:
        if iteration:
            notes.append("the source records no scheduler position or global batch size; a resumed run takes the "
                         "iteration count as the applied steps")
        return iteration, consumed, iteration
    return iteration, consumed, int(sched["num_steps"]) // int(gbs)


def _read_model(src: TorchDistFolder, args: Any, *, lazy: bool
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """(megatron-core model tensors by key, ours by name, layers); meta tensors when `lazy`."""
    keys = [k for k in src.tensor_keys() if torch_dist_keys.is_model_key(k)]
    for key in keys:
        torch_dist_keys.check_known(key)
    layers = _num_layers(src, keys, args)
    tensors = {k: _meta(src, k) for k in keys} if lazy else read(src, keys)[0]
    swiglu = bool(getattr(args, "swiglu", False))
    ours: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        ours.update(torch_dist_keys.to_ours(key, tensor, swiglu=swiglu, num_layers=layers))
    return tensors, ours, layers


def _meta(src: TorchDistFolder, key: str) -> torch.Tensor:
    record = src.keys[key]
    return torch.empty(record.size, dtype=record.properties.dtype, device="meta")


Layout = torch_dist_optim.ModelSpace | BucketSpace


def _optim_layout(src: TorchDistFolder, megatron: dict[str, torch.Tensor], *, tp: int, pp: int, swiglu: bool,
                  num_layers: int) -> Layout:
    """Where the optimizer state lies, nothing read but the bucket space's sample (ValueError as read_adam)."""
    layout = torch_dist_optim.model_space(src)
    if layout is not None:
        return layout
    return bucket_space(src, megatron, tp=tp, pp=pp, swiglu=swiglu, num_layers=num_layers)


def _meta_adam(src: TorchDistFolder, layout: Layout, megatron: dict[str, torch.Tensor]) -> torch_dist_optim.Adam:
    """torch_dist_optim.read_adam's result as meta tensors."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    if isinstance(layout, BucketSpace):  # fp32 as the whole read's _place makes them
        for key in layout.model_keys():
            state[key] = {what: torch.empty(megatron[key].shape, dtype=torch.float32, device="meta")
                          for what in torch_dist_optim.KEYS}
    else:
        for key, (what, model_key) in layout.keys.items():
            state.setdefault(model_key, {})[what] = _meta(src, key)
    return torch_dist_optim.Adam(state=state, step=layout.step, hyper=layout.hyper)


def import_torch_dist(folder: Path, *, vocab_size: int | None = None, stream_budget: int | None = None,
                      weights_only: bool = False) -> TorchDistImport:
    """The torch_dist checkpoint in `folder` (an iteration folder) as our WholeCheckpoint at TP 1 x PP 1.

    With `stream_budget` (bytes), nothing is read yet but the dp_reshardable layout's sample (torch_dist_buckets.py):
    the whole's tensors are meta and the result's `source` reads them a unit at a time for stream.reshard or the
    Hugging Face export (torch_dist_stream.py), holding about that many bytes at most. `weights_only`: its source
    reads no moments (the weights still come from the fp32 masters where the optimizer kept them, as the whole read
    takes them)."""
    src = open_folder(folder)
    args = _args(src)
    megatron_args.check_architecture({"args": args}, where=folder)
    notes: list[str] = []
    tp, pp = int(getattr(args, "tensor_model_parallel_size", 1)), int(getattr(args, "pipeline_model_parallel_size", 1))
    dp = int(getattr(args, "data_parallel_size", 0) or 0) or 1
    lazy = stream_budget is not None
    megatron, model, layers = _read_model(src, args, lazy=lazy)
    cfg = megatron_args.model_config({"args": args}, model, where=folder, vocab_size=vocab_size, notes=notes)
    iteration, consumed, lr_steps = _progress(src, args, notes)
    optimizer, layout = None, None
    try:
        if lazy:
            layout = _optim_layout(src, megatron, tp=tp, pp=pp, swiglu=cfg["swiglu"], num_layers=layers)
            adam = _meta_adam(src, layout, megatron)
        else:
            adam = torch_dist_optim.read_adam(src, megatron, tp=tp, pp=pp, swiglu=cfg["swiglu"], num_layers=layers)
    except ValueError as exc:
        notes.append(f"the source's optimizer state was not carried over: {exc}; a resumed run starts Adam's "
                     "moments at zero")
    else:
        optimizer = _our_adam(adam, model, swiglu=cfg["swiglu"], num_layers=layers, lr_steps=lr_steps)
    model = {n: model[n] for n in pp_layout.model_order(model)}
    optim, train = _train_settings(args)
    state = _state(src, args, cfg, model, iteration=iteration, consumed=consumed, lr_steps=lr_steps,
                   rng=rng_states({"rng_state": _rng_entries(src)}, notes), saved=(tp, pp, dp))
    state["resolved_config"].update(optim=optim, train=train)
    if optimizer is not None:
        state["optimizer"] = optimizer
    manifest = Manifest(iteration=iteration, format="torch", tensor_parallel=1, pipeline_parallel=1,
                        data_parallel=1, world_size=1)
    whole = WholeCheckpoint(found=FoundCheckpoint(folder=folder, manifest=manifest), grid=[[state]])
    source, reader = None, None
    if lazy:
        assert stream_budget is not None
        carried = layout if optimizer is not None else None
        source, reader = _streamed(src, whole, megatron, carried, moments=not weights_only, swiglu=cfg["swiglu"],
                                   num_layers=layers, budget=stream_budget)
    return TorchDistImport(imported=Imported(whole=whole, family=FAMILY, notes=list(dict.fromkeys(notes)),
                                             source=source), saved=(tp, pp, dp), reader=reader)


def _streamed(src: TorchDistFolder, whole: WholeCheckpoint, megatron: dict[str, torch.Tensor], layout: Layout | None,
              *, moments: bool, swiglu: bool, num_layers: int, budget: int) -> tuple[stream.Source, StreamedReader]:
    """stream.Source over `whole` (meta) whose weights (and with `moments`, Adam's) a StreamedReader reads; with an
    optimizer `layout` each weight from its fp32 master where the optimizer kept one, as _our_adam takes it."""
    by_model: dict[str, dict[str, str]] = {key: {"weight": key} for key in megatron}
    flats: dict[tuple[str, str], str] = {}  # (model key, role) -> what of the bucket space
    if isinstance(layout, BucketSpace):
        for model_key in layout.model_keys():
            for what in torch_dist_optim.KEYS if moments else ("param",):
                role = "weight" if what == "param" else what
                by_model[model_key][role] = f"{model_key}#{what}"  # names the cache entry, not a key of the file
                flats[(model_key, role)] = what
    for key, (what, model_key) in (layout.keys.items() if isinstance(layout, torch_dist_optim.ModelSpace) else ()):
        if what == "param" or moments:
            by_model[model_key]["weight" if what == "param" else what] = key
    roles: dict[str, dict[str, Slot]] = {}
    for model_key, sources in by_model.items():
        for role, source_key in sources.items():
            for name, slot in slots(model_key, megatron[model_key].shape, source_key=source_key, swiglu=swiglu,
                                    num_layers=num_layers).items():
                if (model_key, role) in flats:
                    assert isinstance(layout, BucketSpace)
                    slot = replace(slot, flat=layout.flats[(model_key, slot.layer, flats[(model_key, role)])])
                roles.setdefault(name, {})[role] = slot
    reader = StreamedReader(src=src, roles=roles, budget=budget)
    source = stream.Source(whole=whole, weight=lambda p, t, name: reader.fetch(name, "weight"),
                           release=lambda p, t, name: reader.release(name),
                           moment=lambda p, t, name, what: reader.fetch(name, what),
                           unit=lambda p, t, name: reader.roles[name]["weight"].unit)
    return source, reader


def _our_adam(adam: torch_dist_optim.Adam, model: dict[str, torch.Tensor], *, swiglu: bool, num_layers: int,
              lr_steps: int) -> dict[str, Any]:
    """Our AdamW state_dict for `model` (whose weights become the fp32 masters where the source kept them)."""
    step = torch.tensor(float(adam.step if adam.step is not None else lr_steps), dtype=torch.float32)
    moments: dict[str, dict[str, Any]] = {}
    for key, tensors in adam.state.items():
        per = {what: torch_dist_keys.to_ours(key, t, swiglu=swiglu, num_layers=num_layers)
               for what, t in tensors.items()}
        for name in per["exp_avg"]:
            moments[name] = {"step": step.clone(), "exp_avg": per["exp_avg"][name].float().contiguous(),
                             "exp_avg_sq": per["exp_avg_sq"][name].float().contiguous()}
            if "param" in per:
                model[name] = per["param"][name].float().contiguous()
    missing = sorted(set(model) - set(moments))
    if missing:
        raise CheckpointError(f"the checkpoint's Adam state has no moments for {missing[:3]}; it is damaged")
    ordered = {n: model[n] for n in pp_layout.model_order(model)}
    return optim_layout.indexed(moments, model=ordered, groups=adam_groups(adam.hyper))


def _rng_entries(src: TorchDistFolder) -> list[Any]:
    """Megatron's per-DP-rank RNG dicts of the (pp 0, tp 0) rank: the rng_state ShardedObject holds its shards'
    data, each the list Megatron-LM's get_rng_state made."""
    first = [k for k in src.object_keys() if k.startswith("rng_state/shard_0.0_")]
    if not first:
        return []
    _, objects = read(src, first)
    value = objects[first[0]]
    return value[0] if isinstance(value, list) and value and isinstance(value[0], list) else []


def _state(src: TorchDistFolder, args: Any, cfg: dict[str, Any], model: dict[str, torch.Tensor], *, iteration: int,
           consumed: int, lr_steps: int, rng: list[dict[str, Any]] | None,
           saved: tuple[int, int, int]) -> dict[str, Any]:
    """Our one rank's state (checkpoint/store/contents.py keys)."""
    out: dict[str, Any] = {
        "num_layers": cfg["num_layers"], "hidden_size": cfg["hidden_size"],
        "num_attention_heads": cfg["num_attention_heads"], "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "consumed_train_samples": consumed,
        "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
        "max_position_embeddings": cfg["max_position_embeddings"],
        "make_vocab_size_divisible_by": cfg["make_vocab_size_divisible_by"],
        "padded_vocab_size": model["wte.weight"].shape[0], "tokenizer_type": getattr(args, "tokenizer_type", None),
        "checkpoint_version": 3.0, "iteration": iteration, "model": model,
        "lr_scheduler": {"successful_steps": lr_steps},
        "resolved_config": {"model": cfg, "data": {k: v for k in ("tokenizer_type", "vocab_file", "merge_file")
                                                   if isinstance(v := getattr(args, k, None), str)}},
        "converted_from": {"family": FAMILY, "folder": str(src.folder), "format": "torch_dist",
                           "tensor_parallel": saved[0], "pipeline_parallel": saved[1], "data_parallel": saved[2],
                           "checkpoint_version": float(src.common.get("checkpoint_version", 0) or 0),
                           "iteration": iteration},
    }
    if rng is not None:
        out.update(rng[0])
        out["rng_state"] = rng
    return out


def torch_dist_summary(folder: Path, *, verify: bool = False) -> dict[str, Any]:
    """What `ckpt inspect` prints of a torch_dist folder: the args' sizes and every stored key (from the index: no
    tensor data is read). With `verify` every saved chunk and object is read through torch's reader first (the
    format keeps no checksums; a chunk that does not load is the damage found)."""
    src = open_folder(folder)
    if verify:
        _read_every_chunk(src)
    args = src.common.get("args")
    top = {"args": args} if args is not None else {}
    rows = [{"name": k, "shape": list(v.size), "dtype": str(v.properties.dtype).removeprefix("torch.")}
            for k, v in src.keys.items() if hasattr(v, "size")]
    rows += [{"name": k, "shape": [], "dtype": "object"} for k in src.object_keys()]
    return {"path": str(folder), "family": FAMILY, "iteration": src.common.get("iteration"), "format": "torch_dist",
            "tensor_parallel": arg(top, "tensor_model_parallel_size"),
            "pipeline_parallel": arg(top, "pipeline_model_parallel_size"),
            "virtual_pipeline": arg(top, "virtual_pipeline_model_parallel_size"),
            "data_parallel": arg(top, "data_parallel_size"), "world_size": arg(top, "world_size"),
            "files": len(list(folder.iterdir())), "bytes": sum(p.stat().st_size for p in folder.iterdir()
                                                             if p.is_file()),
            "checkpoint_version": src.common.get("checkpoint_version"),
            "optimizer": (src.common.get("optimizer") or {}).get("param_state_sharding_type", "adam")
            if isinstance(src.common.get("optimizer"), dict) else None,
            "model": {k: arg(top, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                                "padded_vocab_size", "max_position_embeddings", "normalization",
                                                "swiglu", "tokenizer_type")},
            "consumed_train_samples": arg(top, "consumed_train_samples"), "precision": None, "tensors": rows,
            "verified": verify}


def _read_every_chunk(src: TorchDistFolder) -> None:
    """Each saved chunk of each key read on its own (one rank's shard at most in memory), then the objects."""
    for key in src.tensor_keys():
        for chunk in src.keys[key].chunks:
            read(src, [key], boxes={key: (tuple(chunk.offsets), tuple(chunk.sizes))})
    read(src, src.object_keys())
