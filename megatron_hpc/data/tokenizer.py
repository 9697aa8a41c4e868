"""GPT-2 byte-level BPE (Megatron's GPT2BPETokenizer) on top of the `tokenizers` library.

Files are GPT-2's: `vocab.json` (token -> id) and `merges.txt` (a `#version` line, then one
"left right" merge per line in rank order). Megatron core 0.16 builds GPT2BPETokenizer as a
HuggingFace GPT2TokenizerFast from these two files
(megatron/core/tokenizers/text/libraries/megatron_hf_tokenizer.py): byte-level pre-tokenization
with GPT-2's regex, no prefix space, and `<|endoftext|>` as a special token, so the literal text
`<|endoftext|>` becomes the EOD id. The `--legacy-tokenizer` path (OpenAI's encoder.py port)
splits that literal into BPE pieces instead; every other text gives the same ids in both.
EOD is the id of `<|endoftext|>` in vocab.json. `fast_encoder` gives the same ids several times
faster for bulk work (fast_encode.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from megatron_hpc.data.fast_encode import WordCacheEncoder
from megatron_hpc.data.jsonl import open_jsonl
from megatron_hpc.errors import DataError

EOD_TOKEN = "<|endoftext|>"
MERGES_HEADER = "#version: 0.2"


def _tokenizers():
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - install problem
        raise DataError("the `tokenizers` package is missing; pip install tokenizers") from exc
    return tokenizers


def _read_vocab(path: Path) -> dict[str, int]:
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"vocab file {path} not found; pass --vocab-file (GPT-2 vocab.json)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a GPT-2 vocab.json ({exc}); expected a JSON object token -> id") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise DataError(f"{path}: not a GPT-2 vocab.json; expected a JSON object token -> integer id")
    return vocab


def _read_merges(path: Path) -> list[tuple[str, str]]:
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except FileNotFoundError:
        raise DataError(f"merge file {path} not found; pass --merge-file (GPT-2 merges.txt)") from None
    merges = []
    for number, line in enumerate(lines, start=1):
        if not line or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise DataError(f"{path}:{number}: expected 'left right', found {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


class GPT2BPETokenizer:
    """Encode and decode with GPT-2 vocab.json + merges.txt; batches run on Rust threads."""

    def __init__(self, vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str]):
        tk = _tokenizers()
        self.vocab_file, self.merge_file = Path(vocab_file), Path(merge_file)
        self.vocab = _read_vocab(self.vocab_file)
        merges = _read_merges(self.merge_file)
        for left, right in merges:
            for piece in (left, right, left + right):
                if piece not in self.vocab:
                    raise DataError(f"{self.merge_file}: merge {left!r} {right!r} uses {piece!r}, which is not in "
                                    f"{self.vocab_file}; the two files do not belong together")
        self._merges = merges
        model = tk.models.BPE(vocab=self.vocab, merges=merges)
        tok = tk.Tokenizer(model)
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = tk.decoders.ByteLevel()
        if EOD_TOKEN in self.vocab:
            tok.add_special_tokens([tk.AddedToken(EOD_TOKEN, special=True, normalized=False)])
        self._tok = tok

    @property
    def vocab_size(self) -> int:
        """Entries of vocab.json (what Megatron's tokenizer reports and sizes the dtype by)."""
        return len(self.vocab)

    @property
    def eod(self) -> int:
        if EOD_TOKEN not in self.vocab:
            raise DataError(f"{self.vocab_file} has no {EOD_TOKEN} token, so there is no EOD id for --append-eod; "
                            "use a GPT-2 vocab or one made by `megatron-hpc data train-tokenizer`")
        return self.vocab[EOD_TOKEN]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (parallel in Rust unless TOKENIZERS_PARALLELISM=false)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def fast_encoder(self, dtype: np.dtype | type[np.generic]) -> WordCacheEncoder:
        """A word-caching encoder that gives `encode`'s ids as bytes of `dtype`, several times faster
        (megatron_hpc/data/fast_encode.py explains why it is exact). Not shared between processes."""
        tk = _tokenizers()
        word_tok = tk.Tokenizer(tk.models.BPE(vocab=self.vocab, merges=self._merges))
        word_tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        special = {EOD_TOKEN: self.vocab[EOD_TOKEN]} if EOD_TOKEN in self.vocab else {}
        return WordCacheEncoder(word_tok, tokenizers_module=tk, dtype=np.dtype(dtype), special=special)

    def bulk_encoder(self, dtype: np.dtype | type[np.generic]) -> WordCacheEncoder:
        """What preprocessing encodes with (text_tokenizers.TextTokenizer): the fast encoder."""
        return self.fast_encoder(dtype)

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes of every token, joined and decoded as UTF-8 with U+FFFD for broken sequences."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save_hf(self, out: str | os.PathLike[str], *, model_max_length: int) -> list[Path]:
        """Write what `transformers`' GPT-2 tokenizer loads from a folder; the paths written.

        vocab.json and merges.txt are copied byte for byte; tokenizer_config.json names the class and the
        settings that give our ids (no prefix space, no BOS added, U+FFFD for broken UTF-8), and
        special_tokens_map.json makes `<|endoftext|>` GPT-2's BOS, EOS and unknown token, as in GPT-2's own
        folder. Without `<|endoftext|>` in the vocabulary the three are null: GPT2Tokenizer would otherwise
        default them to `<|endoftext|>` and add it as a new id the model does not have.
        """
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        eod = EOD_TOKEN if EOD_TOKEN in self.vocab else None
        specials = {name: eod for name in ("bos_token", "eos_token", "unk_token")}
        config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length,
                  "add_prefix_space": False, "add_bos_token": False, "errors": "replace", **specials}
        written = []
        for name, data in (("vocab.json", self.vocab_file.read_bytes()), ("merges.txt", self.merge_file.read_bytes()),
                           ("tokenizer_config.json", (json.dumps(config, indent=2) + "\n").encode()),
                           ("special_tokens_map.json",
                            (json.dumps({k: v for k, v in specials.items() if v}, indent=2) + "\n").encode())):
            (folder / name).write_bytes(data)
            written.append(folder / name)
        return written


def _training_texts(paths: Sequence[Path], json_key: str) -> Iterator[str]:
    for path in paths:
        if not path.is_file():
            raise DataError(f"training input {path} not found")
        if path.name.endswith((".jsonl", ".jsonl.gz", ".json")):
            with open_jsonl(path) as (lines, _):
                for line in lines:
                    try:
                        text = json.loads(line).get(json_key)
                    except (ValueError, AttributeError):
                        continue
                    if isinstance(text, str):
                        yield text
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(
    inputs: Sequence[str | os.PathLike[str]],
    *,
    vocab_size: int,
    output_dir: str | os.PathLike[str],
    json_key: str = "text",
) -> tuple[Path, Path]:
    """Train byte-level BPE and write GPT-2 `vocab.json` + `merges.txt`; returns their paths.

    The 256 byte tokens come first, then merges by rank, and `<|endoftext|>` takes the last id
    (vocab_size - 1), as in GPT-2's own vocab. JSONL inputs contribute their `json_key` text,
    any other file its whole text.
    """
    tk = _tokenizers()
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise DataError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs the {len(alphabet)} byte "
                        f"tokens, at least one merge and {EOD_TOKEN}; use >= {len(alphabet) + 2}")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=sorted(alphabet),
                                     special_tokens=[], show_progress=False)
    tok.train_from_iterator(_training_texts([Path(p) for p in inputs], json_key), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    if EOD_TOKEN in vocab:  # only if the corpus spelled it out often enough to be merged
        raise DataError(f"the training text produced {EOD_TOKEN} as a merged token; remove it from the inputs")
    vocab[EOD_TOKEN] = len(vocab)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_path, merges_path = out / "vocab.json", out / "merges.txt"
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    # Megatron's legacy reader drops the first and the last line (`split('\n')[1:-1]`), so the
    # header and the final newline are both required.
    merges_path.write_text(MERGES_HEADER + "\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return vocab_path, merges_path
