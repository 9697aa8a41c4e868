"""Megatron's HuggingFaceTokenizer from a local `tokenizer.json`, run by the `tokenizers` library (no download).

What Megatron does (megatron/training/tokenizer/tokenizer.py `_HuggingFaceTokenizer`, and the default path of
Megatron-LM HEAD, megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py): `AutoTokenizer.from_pretrained
(--tokenizer-model)`, ids = `tokenizer(text).input_ids` (the special tokens its post-processor adds, a Llama BOS for
instance), EOD = `eos_token_id`, vocabulary = `len(tokenizer)` (added tokens included). A fast tokenizer is the
folder's tokenizer.json run by `tokenizers`, so this module runs that file itself and reads the two settings
transformers takes from the folder's JSON files:

* the EOS token: special_tokens_map.json, else tokenizer_config.json, else the class default of the
  tokenizer_class named there (GPT-NeoX and GPT-2: `<|endoftext|>`, Llama: `</s>`);
* for the classes whose fast tokenizer rebuilds its post-processor (transformers 4.x `LlamaTokenizerFast`,
  `GPTNeoXTokenizerFast`, `update_post_processor`), `add_bos_token` / `add_eos_token` decide which of BOS and EOS
  are added, with the class defaults (Llama: BOS only; GPT-NeoX: neither).

Matched: transformers 4.x, what Megatron-LM 0.16.1 runs with (tests/fixtures/make_tokenizer_expected.py), and the
generic PreTrainedTokenizerFast of transformers 5. transformers 5 ignores add_bos_token/add_eos_token and rebuilds
a Llama tokenizer's pipeline from its class instead of tokenizer.json, which can give other ids (runs of spaces).

A bare tokenizer.json (no folder), as GPT-NeoX's `--tokenizer-type HFTokenizer --vocab-file 20B_tokenizer.json`
takes it, follows GPT-NeoX's HFTokenizer (megatron/tokenizer/tokenizer.py there): EOD is `<|endoftext|>`.
Megatron-LM 0.16.1's default path without `--tokenizer-hf-include-special-tokens` leaves the special tokens out:
`special_tokens=False` (`--tokenizer-hf-no-include-special-tokens`) gives those ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hpc.errors import DataError

TOKENIZER_JSON = "tokenizer.json"
NEOX_EOD = "<|endoftext|>"
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    # tokenizer_class -> transformers 4.x defaults of its fast class (tokenization_*_fast.py __init__)
    "GPTNeoXTokenizer": {"bos_token": NEOX_EOD, "eos_token": NEOX_EOD, "add_bos_token": False,
                         "add_eos_token": False},
    "LlamaTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False},
    "CodeLlamaTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False},
    "GPT2Tokenizer": {"bos_token": NEOX_EOD, "eos_token": NEOX_EOD},
}
"""Fast classes whose post-processor is rebuilt from add_bos_token/add_eos_token have both keys here."""


def _tokenizers():
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - install problem
        raise DataError("HuggingFaceTokenizer needs the `tokenizers` package; pip install tokenizers") from None
    return tokenizers


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc}); restore the file from the tokenizer's folder") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _locate(path: Path) -> tuple[Path, Path | None]:
    """(tokenizer.json, its folder or None for a bare file)."""
    if path.is_dir():
        if not (path / TOKENIZER_JSON).is_file():
            raise DataError(f"{path} has no {TOKENIZER_JSON}; HuggingFaceTokenizer runs the fast tokenizer file "
                            f"(write it with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir))")
        return path / TOKENIZER_JSON, path
    if path.is_file():
        return path, None
    raise DataError(f"--tokenizer-model {path} not found; pass the tokenizer's folder (with {TOKENIZER_JSON}) or the "
                    f"{TOKENIZER_JSON} file itself")


class HuggingFaceTokenizer:
    """Encode and decode as Megatron's HuggingFaceTokenizer does with a local folder (module docstring)."""

    def __init__(self, path: str | os.PathLike[str], *, special_tokens: bool = True):
        tk = _tokenizers()
        self.path = Path(path).expanduser()
        self.file, folder = _locate(self.path)
        try:
            self._tok = tk.Tokenizer.from_file(str(self.file))
        except Exception as exc:  # tokenizers raises its own Exception subclass for a bad file
            raise DataError(f"{self.file}: not a tokenizers JSON file ({exc}); pass the tokenizer.json a "
                            f"Hugging Face tokenizer folder ships") from None
        self.special_tokens = special_tokens
        settings = self._settings(folder)
        self.eos_token: str | None = settings.get("eos_token")
        if {"add_bos_token", "add_eos_token"} <= settings.keys():
            self._rebuild_post_processor(tk, settings)

    def _settings(self, folder: Path | None) -> dict[str, Any]:
        """EOS/BOS tokens and add_*_token as transformers resolves them (module docstring)."""
        if folder is None:
            return {"eos_token": NEOX_EOD}
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        cls = str(config.get("tokenizer_class") or "").removesuffix("Fast")
        settings = dict(_CLASS_DEFAULTS.get(cls, {}))
        for key in ("add_bos_token", "add_eos_token"):
            if key in settings and isinstance(config.get(key), bool):
                settings[key] = config[key]
        for key in ("bos_token", "eos_token"):
            # special_tokens_map.json wins over tokenizer_config.json, as in transformers' from_pretrained
            for source in (special_map, config):
                text = _token_text(source.get(key))
                if text is not None:
                    settings[key] = text
                    break
        return settings

    def _rebuild_post_processor(self, tk: Any, settings: dict[str, Any]) -> None:
        parts, specials = ["$A:0"], []
        for key, token, at_end in (("add_bos_token", "bos_token", False), ("add_eos_token", "eos_token", True)):
            text = settings.get(token)
            if not settings[key] or text is None:
                continue
            token_id = self._tok.token_to_id(text)
            if token_id is None:
                raise DataError(f"{self.path}: {token} {text!r} is not in {TOKENIZER_JSON}; fix "
                                f"tokenizer_config.json or set {key} false")
            parts.insert(len(parts) if at_end else 0, f"{text}:0")
            specials.append((text, token_id))
        single = " ".join(parts)
        pair = " ".join([*parts, *(p.replace("$A", "$B").replace(":0", ":1") for p in parts)])
        self._tok.post_processor = tk.processors.TemplateProcessing(single=single, pair=pair,
                                                                    special_tokens=specials)

    @property
    def vocab_size(self) -> int:
        """Ids of tokenizer.json with its added tokens: `len(tokenizer)` in transformers and Megatron."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if token_id is None:
            what = f"its eos_token {self.eos_token!r} is not in {TOKENIZER_JSON}" if self.eos_token else \
                "it names no eos_token"
            raise DataError(f"{self.path}: {what}, so there is no EOD id for --append-eod; set \"eos_token\" in "
                            f"the folder's tokenizer_config.json to a token of the vocabulary")
        return token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.special_tokens).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def bulk_encoder(self, dtype: np.dtype | type[np.generic]) -> _BatchEncoder:
        return _BatchEncoder(self._tok, np.dtype(dtype), special_tokens=self.special_tokens)


class _BatchEncoder:
    """Many texts at once through `encode_batch_fast` (no offsets) where the installed tokenizers has it."""

    def __init__(self, tok: Any, dtype: np.dtype, *, special_tokens: bool):
        self._encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        self._dtype, self._special = dtype, special_tokens

    def encode(self, texts: Sequence[str]) -> list[bytes]:
        encodings = self._encode(list(texts), add_special_tokens=self._special)
        return [np.asarray(e.ids, dtype=self._dtype).tobytes() for e in encodings]
