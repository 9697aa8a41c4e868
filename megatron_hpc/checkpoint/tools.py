"""`ckpt convert` and `ckpt reshard`: a checkpoint to a Hugging Face folder (the mapping of each architecture is
in hf_gpt2.py and its siblings, chosen by hf_formats.py), to another format, or to another TP x PP size. Offline,
one process, CPU.
"""

from __future__ import annotations

import copy
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint import hf_formats, optim_layout, pp_layout, tp_layout
from megatron_hpc.checkpoint.compat import PipelineLayout
from megatron_hpc.checkpoint.host_memory import give_back_freed
from megatron_hpc.checkpoint.whole import WholeCheckpoint, write_whole
from megatron_hpc.errors import CheckpointError, PlanError
from megatron_hpc.plan.vocab import padded_vocab_size


def _model_config(whole: WholeCheckpoint) -> dict[str, Any]:
    try:
        return whole.first["resolved_config"]["model"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{whole.found.folder} has no resolved_config (not written by megatron-hpc); "
                              "it cannot be converted") from None


# ---------------------------------------------------------------------------------------------- HF export

def export_hf(whole: WholeCheckpoint, out: Path, *, eos_token_id: int | None = None) -> Path:
    """Write config.json and the weights (model.safetensors, or pytorch_model.bin without safetensors) of the first
    Hugging Face architecture (hf_formats.py) that can express the model."""
    model = _model_config(whole)
    fmt, hf_config = hf_formats.for_model(model, eos_token_id=eos_token_id, where=whole.found.folder)
    full = pp_layout.merge_grid([[s["model"] for s in row] for row in whole.grid], num_layers=model["num_layers"])
    sd = fmt.state_to_hf(full, model)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps(hf_config, indent=2) + "\n")
    try:
        from safetensors.torch import save_file
    except ImportError:
        path = out / "pytorch_model.bin"
        torch.save(sd, path)
    else:
        path = out / "model.safetensors"
        save_file(sd, str(path), metadata={"format": "pt"})
        # safetensors creates its file with mode 0600 whatever the umask, so a folder meant for others to load
        # was unreadable to them; it gets the mode of the config.json beside it (0666 less the umask).
        path.chmod(stat.S_IMODE(config.stat().st_mode))
    return path


def tokenizer_files(whole: WholeCheckpoint) -> tuple[Path, Path] | str:
    """The run's GPT-2 vocab.json and merges.txt (its resolved data.vocab_file, data.merge_file), or why there
    are none to export."""
    return resolved_tokenizer_files(whole.first.get("resolved_config") if isinstance(whole.first, dict) else None)


def resolved_tokenizer_files(resolved: Any) -> tuple[Path, Path] | str:
    """tokenizer_files from a checkpoint's resolved config (one shard's "resolved_config")."""
    try:
        data = resolved["data"]
    except (KeyError, TypeError):
        return "the checkpoint has no resolved data config"
    if data.get("source") == "synthetic":
        return "the run trained on synthetic tokens (data.source=synthetic)"
    if data.get("tokenizer_type", "GPT2BPETokenizer") != "GPT2BPETokenizer":
        return f"the run's tokenizer is {data['tokenizer_type']}, not GPT2BPETokenizer"
    if not data.get("vocab_file") or not data.get("merge_file"):
        return "the run names no data.vocab_file and data.merge_file"
    found = (Path(data["vocab_file"]).expanduser(), Path(data["merge_file"]).expanduser())
    for key, path in zip(("data.vocab_file", "data.merge_file"), found):
        if not os.access(path, os.R_OK) or not path.is_file():
            why = "not readable" if path.exists() else "gone"
            return f"the run's {key} {path} is {why}"
    return found


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_tokenizer_files(whole: WholeCheckpoint) -> list[Path]:
    """The run's Hugging Face tokenizer files (data.tokenizer_type HuggingFaceTokenizer: tokenizer.json and the
    settings beside it in data.tokenizer_model), to copy as they are; empty when the run names none."""
    data = (whole.first.get("resolved_config") or {}).get("data") or {}
    if data.get("tokenizer_type") != "HuggingFaceTokenizer" or not data.get("tokenizer_model"):
        return []
    given = Path(data["tokenizer_model"]).expanduser()
    folder = given if given.is_dir() else given.parent
    main = folder / HF_TOKENIZER_FILES[0] if given.is_dir() else given
    if not main.is_file() or not os.access(main, os.R_OK):
        return []
    return [main, *(folder / n for n in HF_TOKENIZER_FILES[1:] if given.is_dir() and (folder / n).is_file())]


# ---------------------------------------------------------------------------------------------- reshard

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
    if tp < 1 or heads % tp or ffn % tp:
        choices = [d for d in range(1, heads + 1) if heads % d == 0 and ffn % d == 0]
        raise CheckpointError(f"--tp {tp} must be at least 1 and divide the {heads} attention heads and the FFN "
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


def _resized(state: dict[str, Any], *, tp: int, layout: PipelineLayout, padded: int) -> dict[str, Any]:
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


def reshard(whole: WholeCheckpoint, *, tp: int, pp: int = 1, virtual: int = 1, first_stage_layers: int = 0,
            last_stage_layers: int = 0, out: Path, fmt: str | None = None, release: bool = False) -> ReshardResult:
    """Write `whole` at TP size `tp` and pipeline size `pp` (with `virtual` chunks per pipeline rank and optional
    uneven first/last stages, as parallel.* names them) into `out`: same iteration, the vocabulary re-padded for
    `tp`, Adam's moments moved by name (dropped, with the reason in the result's note, when they cannot be).

    `release`: let go of `whole`'s weights as their new pieces are made (they become meta tensors of their shape), so
    the model is held about once instead of three times; `whole`'s weights are unusable afterwards."""
    model = _model_config(whole)
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
            state = _resized(whole.first, tp=tp, layout=layout, padded=padded)
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


def convert_format(whole: WholeCheckpoint, *, to: str, out: Path) -> Path:
    """The same checkpoint (every rank, every key) in the other file format."""
    return write_whole(out, whole.iteration, whole.grid, fmt=to, layout=whole.layout)
