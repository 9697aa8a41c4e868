"""The run's tokenizer files, found through a checkpoint's resolved config: the GPT-2 vocab.json and merges.txt
(`generate`, `evaluate` and `ckpt convert --to hf` use them) or a Hugging Face tokenizer.json and its settings
(copied beside an HF export, checkpoint/foreign/hf_export.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatron_hpc.checkpoint.conversion.whole import WholeCheckpoint


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


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
"""generation_config.json is an imported model's (checkpoint/foreign/hf_import.py), carried to the export."""


def hf_tokenizer_files(whole: WholeCheckpoint) -> list[Path]:
    """The run's Hugging Face tokenizer files (data.tokenizer_type HuggingFaceTokenizer: tokenizer.json and the
    settings beside it in data.tokenizer_model), to copy as they are; empty when the run names none."""
    data = (whole.first.get("resolved_config") or {}).get("data") or {}
    if data.get("tokenizer_type") == "Llama2Tokenizer" and data.get("tokenizer_model"):
        model = Path(data["tokenizer_model"]).expanduser()  # Llama 2's SentencePiece tokenizer.model
        if not model.is_file() or not os.access(model, os.R_OK):
            return []
        # Its settings go too: tokenizer_config.json names the class (LlamaTokenizer, which adds BOS) that
        # AutoTokenizer builds; without it the export loads as another tokenizer, giving other ids.
        beside = [model.parent / n for n in HF_TOKENIZER_FILES[1:]]
        return [model, *(f for f in beside if f.is_file())]
    if data.get("tokenizer_type") != "HuggingFaceTokenizer" or not data.get("tokenizer_model"):
        return []
    given = Path(data["tokenizer_model"]).expanduser()
    folder = given if given.is_dir() else given.parent
    main = folder / HF_TOKENIZER_FILES[0] if given.is_dir() else given
    if not main.is_file() or not os.access(main, os.R_OK):
        return []
    return [main, *(folder / n for n in HF_TOKENIZER_FILES[1:] if given.is_dir() and (folder / n).is_file())]
