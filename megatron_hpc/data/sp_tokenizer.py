"""Megatron's SentencePiece tokenizers (SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer).

Default (Megatron-LM HEAD, and 0.16.1 without --legacy-tokenizer: megatron/core/tokenizers/text/libraries/
sentencepiece_tokenizer.py with legacy=False and ignore_extra_whitespaces=True): all three types are the same
tokenizer. Ids are `encode_as_ids(text)`, EOD is the model's `eos_id()` and the vocabulary is `get_piece_size()`.

`legacy=True` (--legacy-tokenizer; megatron/training/tokenizer/tokenizer.py, what Megatron-LM did before its
tokenizer rewrite), per type:

* SentencePieceTokenizer: `<CLS>`, `<SEP>`, `<EOD>`, `<MASK>` and the model's pad, BOS and EOS pieces (`<PAD>`,
  `<BOS>`, `<EOS>` when the model has none) are special tokens; those missing from the model get the next ids after
  its pieces, so the vocabulary grows. EOD is the id of `<EOD>`. Text is cut at every special token's literal
  (the earliest first; on a tie, the first in that list) and the pieces between are encoded as usual (NeMo's
  scheme).
* Llama2Tokenizer: BOS first, then `encode`; EOD is `eos_id()`; no special tokens added.
* GPTSentencePieceTokenizer: as the default.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_hpc.errors import DataError

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
_LEGACY_SPECIALS = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")


def _load(path: Path) -> Any:
    try:
        import sentencepiece
    except ImportError:
        raise DataError("SentencePiece tokenizers need the `sentencepiece` package; pip install sentencepiece "
                        "(or pip install 'megatron-hpc[tokenizers]')") from None
    if not path.is_file():
        raise DataError(f"--tokenizer-model {path} not found; pass the SentencePiece .model file "
                        f"(tokenizer.model of a Llama folder)")
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as exc:
        raise DataError(f"{path}: not a SentencePiece model ({exc}); pass the .model file") from None
    return processor


def _piece_or(processor: Any, token_id: int, fallback: str) -> str:
    """The piece of a pad/BOS/EOS id, or Megatron's name for it when the model has none (id -1)."""
    return processor.id_to_piece(token_id) if 0 <= token_id < processor.get_piece_size() else fallback


class SentencePieceTokenizer:
    """Encode and decode as Megatron's tokenizer of `kind` does (module docstring)."""

    def __init__(self, model_file: str | os.PathLike[str], *, kind: str = "SentencePieceTokenizer",
                 legacy: bool = False):
        if kind not in SENTENCEPIECE_TYPES:
            raise DataError(f"tokenizer type {kind} is not a SentencePiece type; use one of {SENTENCEPIECE_TYPES}")
        self.path = Path(model_file).expanduser()
        self._sp = _load(self.path)
        self.kind, self.legacy = kind, legacy
        self._num_pieces = self._sp.get_piece_size()
        self.special: dict[str, int] = {}
        """Special token literal -> id, in the order ties are broken (legacy SentencePieceTokenizer only)."""
        if legacy and kind == "SentencePieceTokenizer":
            self._add_legacy_specials()

    def _add_legacy_specials(self) -> None:
        sp = self._sp
        names = [*_LEGACY_SPECIALS, _piece_or(sp, sp.pad_id(), "<PAD>"), _piece_or(sp, sp.bos_id(), "<BOS>"),
                 _piece_or(sp, sp.eos_id(), "<EOS>")]
        pieces = {sp.id_to_piece(i): i for i in range(self._num_pieces)}
        next_id = self._num_pieces
        for name in names:
            if name in self.special:
                continue
            if name in pieces:
                self.special[name] = pieces[name]
            else:
                self.special[name] = next_id
                next_id += 1

    @property
    def vocab_size(self) -> int:
        """Model pieces, plus the special tokens the legacy SentencePieceTokenizer appends."""
        return self._num_pieces + sum(1 for i in self.special.values() if i >= self._num_pieces)

    @property
    def eod(self) -> int:
        if self.special:
            return self.special["<EOD>"]
        eos = self._sp.eos_id()
        if eos < 0:
            raise DataError(f"{self.path} has no end-of-sentence piece (eos_id -1), so there is no EOD id for "
                            f"--append-eod; train the model with an eos piece (sentencepiece's default eos_id=2)")
        return eos

    def encode(self, text: str) -> list[int]:
        if self.special:
            return self._encode_with_specials(text)
        ids = self._sp.encode_as_ids(text)
        if self.legacy and self.kind == "Llama2Tokenizer":
            return [self._sp.bos_id(), *ids]
        return ids

    def _encode_with_specials(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        while True:
            found = [(text.find(name, start), order, name) for order, name in enumerate(self.special)]
            hits = [hit for hit in found if hit[0] >= 0]
            if not hits:
                break
            at, _, name = min(hits)
            ids += self._sp.encode_as_ids(text[start:at])
            ids.append(self.special[name])
            start = at + len(name)
        return ids + self._sp.encode_as_ids(text[start:])

    def decode(self, ids: Iterable[int]) -> str:
        """Pieces decoded by the model; ids past its pieces (legacy special tokens) as their literal."""
        names = {i: name for name, i in self.special.items()}
        out, run = [], []
        for token in (int(i) for i in ids):
            if token < self._num_pieces:
                run.append(token)
                continue
            out += [self._sp.decode_ids(run), names.get(token, "")]
            run = []
        return "".join([*out, self._sp.decode_ids(run)])

    def bulk_encoder(self, dtype: np.dtype | type[np.generic]) -> _BatchEncoder:
        return _BatchEncoder(self, np.dtype(dtype))


class _BatchEncoder:
    def __init__(self, tokenizer: SentencePieceTokenizer, dtype: np.dtype):
        self._tokenizer, self._dtype = tokenizer, dtype

    def encode(self, texts: Sequence[str]) -> list[bytes]:
        return [np.asarray(self._tokenizer.encode(t), dtype=self._dtype).tobytes() for t in texts]
