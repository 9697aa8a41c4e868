"""Which tokenizer Megatron's flags name, and building it: `--tokenizer-type` with its files.

| --tokenizer-type | files | module |
| --- | --- | --- |
| GPT2BPETokenizer | --vocab-file vocab.json, --merge-file merges.txt | tokenizer.py |
| HuggingFaceTokenizer | --tokenizer-model FOLDER (or its tokenizer.json) | hf_tokenizer.py |
| SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer | --tokenizer-model x.model | sp_tokenizer.py |

GPT-NeoX's `--tokenizer-type HFTokenizer --vocab-file 20B_tokenizer.json` (the Pythia/NeoX commands) is taken as
HuggingFaceTokenizer on that file. Each tokenizer gives `vocab_size` (what Megatron sizes the token dtype by and
the model's vocabulary must hold), `eod`, `encode`, `decode` and `bulk_encoder(dtype)` for preprocessing.
`tokenizers` and `sentencepiece` are imported only by the tokenizer that needs them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from megatron_hpc.errors import DataError

GPT2 = "GPT2BPETokenizer"
HUGGINGFACE = "HuggingFaceTokenizer"
SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (GPT2, HUGGINGFACE, *SENTENCEPIECE)
ALIASES = {"HFTokenizer": HUGGINGFACE}
"""Other projects' names for the same tokenizer (GPT-NeoX's tools/datasets/preprocess_data.py)."""


class BulkEncoder(Protocol):
    def encode(self, texts: Sequence[str]) -> list[bytes]:
        """Token ids of each text as bytes of the encoder's dtype."""


class TextTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def bulk_encoder(self, dtype: np.dtype | type[np.generic]) -> BulkEncoder: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerSpec:
    """A tokenizer as Megatron's flags name it; picklable, so preprocessing workers build their own."""

    type: str = GPT2
    """--tokenizer-type (an alias from ALIASES is resolved by `tokenizer_spec`)."""
    vocab_file: str | None = None
    """--vocab-file: GPT-2 vocab.json (GPT-NeoX's HFTokenizer: its tokenizer.json)."""
    merge_file: str | None = None
    """--merge-file: GPT-2 merges.txt."""
    model: str | None = None
    """--tokenizer-model: a Hugging Face folder or tokenizer.json, or a SentencePiece .model."""
    legacy: bool = False
    """--legacy-tokenizer: Megatron's tokenizers before its rewrite (differs for two SentencePiece types)."""
    special_tokens: bool = True
    """HuggingFaceTokenizer: keep the special tokens its post-processor adds (a Llama BOS)."""

    def describe(self) -> str:
        # Only the files this type reads: a recipe's GPT-2 vocab.json and merges.txt stay set under a
        # HuggingFaceTokenizer pasted over it, and naming them would point at the wrong tokenizer.
        read = (self.vocab_file, self.merge_file) if self.type == GPT2 else (self.model,)
        files = [f for f in read if f]
        return f"{self.type} ({', '.join(files)})" if files else self.type


def _path(value: str | os.PathLike[str] | None) -> str | None:
    return os.path.expanduser(os.fspath(value)) if value else None


def tokenizer_spec(tokenizer_type: str = GPT2, *, vocab_file: str | os.PathLike[str] | None = None,
                   merge_file: str | os.PathLike[str] | None = None, model: str | os.PathLike[str] | None = None,
                   legacy: bool = False, special_tokens: bool = True) -> TokenizerSpec:
    """Check that the flags name a tokenizer we build and the files it needs; DataError with the fix if not."""
    kind = ALIASES.get(tokenizer_type, tokenizer_type)
    vocab_file, merge_file, model = _path(vocab_file), _path(merge_file), _path(model)
    if kind not in TOKENIZER_TYPES:
        raise DataError(f"--tokenizer-type {tokenizer_type} is not supported; use one of "
                        f"{', '.join(TOKENIZER_TYPES)} (GPT-NeoX's HFTokenizer is taken as {HUGGINGFACE})")
    if kind == GPT2 and not (vocab_file and merge_file):
        raise DataError(f"{GPT2} needs --vocab-file (vocab.json) and --merge-file (merges.txt)")
    if kind == HUGGINGFACE and not model:
        if not vocab_file:
            raise DataError(f"{HUGGINGFACE} needs --tokenizer-model (the tokenizer's folder, with tokenizer.json)")
        model, vocab_file = vocab_file, None  # GPT-NeoX spells it --vocab-file tokenizer.json
    if kind in SENTENCEPIECE and not model:
        raise DataError(f"{kind} needs --tokenizer-model (the SentencePiece .model file)")
    return TokenizerSpec(type=kind, vocab_file=vocab_file, merge_file=merge_file, model=model, legacy=legacy,
                         special_tokens=special_tokens)


def build_tokenizer(spec: TokenizerSpec) -> TextTokenizer:
    """The tokenizer `spec` names; DataError (with the fix) for missing or unreadable files."""
    spec = tokenizer_spec(spec.type, vocab_file=spec.vocab_file, merge_file=spec.merge_file, model=spec.model,
                          legacy=spec.legacy, special_tokens=spec.special_tokens)  # a spec made by hand, too
    if spec.type == GPT2:
        from megatron_hpc.data.tokenizer import GPT2BPETokenizer

        assert spec.vocab_file and spec.merge_file, "tokenizer_spec checks the GPT-2 files"
        return GPT2BPETokenizer(spec.vocab_file, spec.merge_file)
    assert spec.model, "tokenizer_spec checks --tokenizer-model"
    if spec.type == HUGGINGFACE:
        from megatron_hpc.data.hf_tokenizer import HuggingFaceTokenizer

        return HuggingFaceTokenizer(spec.model, special_tokens=spec.special_tokens)
    from megatron_hpc.data.sp_tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(spec.model, kind=spec.type, legacy=spec.legacy)
