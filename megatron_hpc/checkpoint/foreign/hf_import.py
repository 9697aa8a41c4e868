"""A local Hugging Face model folder as our checkpoint: config.json and its weights (model.safetensors or
pytorch_model.bin, either one file or shards listed by an *.index.json) become our whole model at TP 1 x PP 1,
which stream.reshard then writes at any TP x PP. Nothing downloads; a .bin file goes through our restricted
unpickler (store/safe_pickle.py), so nothing in it runs.

The result is weights only at iteration 0 (an HF folder has no optimizer or progress): the trainer starts from it
with checkpoint.load and checkpoint.finetune=true. The tokenizer files beside the weights are copied next to the
checkpoint and named in its resolved_config's data section, where `generate` and `ckpt convert --to hf` look.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.conversion import WholeCheckpoint, pp_layout
from megatron_hpc.checkpoint.foreign import hf_formats
from megatron_hpc.checkpoint.store import FoundCheckpoint, Manifest, paths, safe_load
from megatron_hpc.errors import CheckpointError, MegatronHpcError

FAMILY = "huggingface"
CONFIG = "config.json"
SAFETENSORS, BIN = "model.safetensors", "pytorch_model.bin"
TOKENIZER_DIR = "tokenizer"
"""Where the tokenizer files go, inside the output checkpoint folder."""
GPT2_TOKENIZER = ("vocab.json", "merges.txt")
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")
"""Copied with the checkpoint. generation_config.json is not the tokenizer's, but it names the ids generation starts
and stops at (Llama 3.1 Instruct stops at three), which the export writes back."""
SENTENCEPIECE = "tokenizer.model"
"""Llama 2's SentencePiece model (Megatron's Llama2Tokenizer), when no tokenizer.json comes with it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HfImport:
    whole: WholeCheckpoint
    architecture: str
    weights: list[Path]
    """The weight files read."""
    tokenizer: list[Path] = field(default_factory=list)
    """The tokenizer files to copy (copy_tokenizer)."""
    notes: list[str] = field(default_factory=list)


def is_hf_folder(path: Path) -> bool:
    """A folder with config.json that is a model's (weights beside it, or it names an architecture or model type),
    not a run folder's resolved config, and no checkpoint tracker. False when it cannot be looked into: the
    checkpoint readers then name the file they cannot read."""
    try:
        if not path.is_dir() or not (path / CONFIG).is_file() or paths.tracker_file(path).is_file():
            return False
        if any((path / n).is_file() for w in (SAFETENSORS, BIN) for n in (w, f"{w}.index.json")):
            return True
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):  # PermissionError included
        return False
    return isinstance(config, dict) and ("architectures" in config or "model_type" in config)


def read_config(folder: Path) -> dict[str, Any]:
    where = folder / CONFIG
    try:
        config = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"cannot read {where} ({type(exc).__name__}: {exc}); pass the folder save_pretrained "
                              "wrote") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{where} is not a JSON object; pass the folder save_pretrained wrote")
    return config


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The weight files to read (safetensors before .bin, as transformers prefers) and, for shards, the index's
    weight -> file map."""
    for name in (SAFETENSORS, BIN):
        if (folder / name).is_file():
            return [folder / name], None
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"cannot read {index} ({type(exc).__name__}: {exc}); it should map each weight "
                                      "to its shard file under 'weight_map'") from None
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise CheckpointError(f"{index} lists {missing[0]}, which is not in {folder}; copy every shard "
                                      "(or the whole folder) again")
            return [folder / f for f in files], weight_map
    raise CheckpointError(f"{folder} has no {SAFETENSORS} or {BIN} (nor their *.index.json shards); copy the model's "
                          "weights next to its config.json")


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.name.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc}); it is truncated or "
                                  "damaged") from None
    state = safe_load(path, what=path)
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(f"{path} is not a state dict of tensors; pass the folder save_pretrained wrote")
    return state


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """Every weight of the folder by its HF name, and the files read; CheckpointError when shards and their
    index disagree."""
    files, weight_map = weight_files(folder)
    out: dict[str, torch.Tensor] = {}
    for path in files:
        state = _read_file(path)
        if weight_map is not None:
            listed = {k for k, f in weight_map.items() if f == path.name}
            if set(state) != listed:
                odd = sorted(set(state) ^ listed)[0]
                where = "in the index but not in the shard" if odd in listed else "in the shard but not in the index"
                raise CheckpointError(f"{path} and the index beside it disagree: {odd} is {where}; copy the shards "
                                      "and their index from one download again")
        out.update(state)
    return out, files


def tokenizer_files(folder: Path) -> list[Path]:
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


def data_config(files: list[Path], out: Path, *, tokenizer_json_first: bool = False) -> dict[str, Any]:
    """resolved_config.data naming the copies of `files` in OUT/tokenizer (absolute: generate reads them from
    anywhere); empty without a tokenizer. GPT-2's vocab.json and merges.txt win over a tokenizer.json beside them
    unless `tokenizer_json_first`: Qwen2 ships both, and GPT-2's BPE would split its text otherwise."""
    names = {p.name for p in files}
    where = (out / TOKENIZER_DIR).absolute()
    if tokenizer_json_first and "tokenizer.json" in names:
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(where)}
    if set(GPT2_TOKENIZER) <= names:
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(where / GPT2_TOKENIZER[0]),
                "merge_file": str(where / GPT2_TOKENIZER[1])}
    if "tokenizer.json" in names:
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(where)}
    if SENTENCEPIECE in names:
        return {"tokenizer_type": "Llama2Tokenizer", "tokenizer_model": str(where / SENTENCEPIECE)}
    return {}


def _check_tokenizer(folder: Path, data: dict[str, Any], vocab_size: int) -> None:
    """The tokenizer (read where it is now) fits the model's vocabulary."""
    from megatron_hpc.data.text_tokenizers import build_tokenizer, tokenizer_spec

    source = {k: str(folder / Path(v).name) if k != "tokenizer_model" else str(folder)
              for k, v in data.items() if k != "tokenizer_type"}
    if data["tokenizer_type"] == "Llama2Tokenizer":
        source["tokenizer_model"] = str(folder / SENTENCEPIECE)
    try:
        tok = build_tokenizer(tokenizer_spec(data["tokenizer_type"], vocab_file=source.get("vocab_file"),
                                             merge_file=source.get("merge_file"), model=source.get("tokenizer_model")))
    except MegatronHpcError as exc:
        raise CheckpointError(f"the tokenizer files in {folder} cannot be read ({exc}); fix or remove them") from None
    if tok.vocab_size > vocab_size:
        raise CheckpointError(f"the tokenizer in {folder} has {tok.vocab_size} tokens but config.json's vocab_size "
                              f"is {vocab_size}; the model cannot embed them all, pass the tokenizer it was "
                              "trained with")


def import_hf(folder: Path, *, out: Path, fmt: str) -> HfImport:
    """The HF model in `folder` as our WholeCheckpoint (TP 1 x PP 1, in memory; `out` and `fmt` are where and how it
    will be written, recorded in its config). Reads and checks everything; writes nothing."""
    config = read_config(folder)
    hf = hf_formats.for_config(config, where=folder / CONFIG)
    # Recorded even at its default: the printed --set list must pin it, as a recipe may pad otherwise.
    model = {"make_vocab_size_divisible_by": 128, **hf.model_config_from_hf(config)}
    tokenizer = tokenizer_files(folder)
    data = data_config(tokenizer, out, tokenizer_json_first=hf.tokenizer_json_first)
    notes = []
    if data:
        _check_tokenizer(folder, data, model["vocab_size"])
    else:
        notes.append(f"{folder} holds no tokenizer files (vocab.json and merges.txt, tokenizer.json or "
                     "tokenizer.model); generate "
                     "needs --vocab-file and --merge-file")
    weights, files = read_weights(folder)
    full = hf.state_from_hf(weights, model)
    del weights
    state = {
        "num_layers": model["num_layers"], "hidden_size": model["hidden_size"],
        "num_attention_heads": model["num_attention_heads"], "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "consumed_train_samples": 0, "consumed_valid_samples": 0,
        "max_position_embeddings": model["max_position_embeddings"],
        "make_vocab_size_divisible_by": model["make_vocab_size_divisible_by"],
        "padded_vocab_size": model["vocab_size"],
        "tokenizer_type": data.get("tokenizer_type"), "checkpoint_version": 3.0, "iteration": 0,
        "model": {n: full[n] for n in pp_layout.model_order(full)},
        "lr_scheduler": {"successful_steps": 0},
        "resolved_config": {"model": model, "data": data},
        "converted_from": {"family": FAMILY, "architecture": hf.architecture, "folder": str(folder.absolute()),
                           "files": [p.name for p in files]},
    }
    manifest = Manifest(iteration=0, format=fmt, tensor_parallel=1, pipeline_parallel=1, data_parallel=1,
                        world_size=1)
    whole = WholeCheckpoint(found=FoundCheckpoint(folder=folder, manifest=manifest), grid=[[state]])
    return HfImport(whole=whole, architecture=hf.architecture, weights=files, tokenizer=tokenizer, notes=notes)


def copy_tokenizer(files: list[Path], out: Path) -> list[Path]:
    """Copy the tokenizer files into OUT/tokenizer; the copies."""
    if not files:
        return []
    where = out / TOKENIZER_DIR
    where.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(p, where / p.name)) for p in files]
