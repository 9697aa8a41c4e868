"""`ckpt convert`'s whole-checkpoint outputs: a Hugging Face folder (the mapping of each architecture is in
hf_gpt2.py and its siblings, chosen by hf_formats.py) with the run's tokenizer files, or the same checkpoint in the
other file format. Offline, one process, CPU. Writing at another TP x PP size is stream.py's.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.conversion import pp_layout
from megatron_hpc.checkpoint.conversion.whole import WholeCheckpoint, model_config, write_whole
from megatron_hpc.checkpoint.foreign import hf_formats


def export_hf(whole: WholeCheckpoint, out: Path, *, eos_token_id: int | None = None) -> Path:
    """Write config.json and the weights (model.safetensors, or pytorch_model.bin without safetensors) of the first
    Hugging Face architecture (hf_formats.py) that can express the model."""
    model = model_config(whole)
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


def convert_format(whole: WholeCheckpoint, *, to: str, out: Path) -> Path:
    """The same checkpoint (every rank, every key) in the other file format."""
    return write_whole(out, whole.iteration, whole.grid, fmt=to, layout=whole.layout)
