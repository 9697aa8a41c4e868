"""Megatron's zero-shot task inputs (tasks/zeroshot_gpt/datasets.py, Megatron-LM fb13c1de21^), from local files:

* WikiText-style perplexity: one UTF-8 text file, read whole. Its word count is taken on the raw text
  (`len(text.strip().split(" "))`, split on single spaces as Megatron does), then the text is detokenized
  (detokenize.py) and tokenized as one sequence. The tokens are read in windows of seq_length + 1 starting every
  `stride` tokens (Megatron --overlapping-eval; default seq_length, no overlap): the first window scores all its
  targets, each later one only its last `stride` targets, the ones no earlier window scored. So every token but
  the first is scored exactly once.
* LAMBADA-style cloze: JSON lines, each an object with a "text" string. Strict (--strict-lambada): the target is
  the tokens of the last whitespace-separated word, encoded with its leading space, and the context is the text
  before it, stripped. Not strict (Megatron's default): the whole text is encoded and the target is its last token.

Everything here is pure but the file reads: windows and examples are plain data for scoring.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_hpc.errors import DataError

Encode = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class Window:
    """Tokens [start, stop) of the document: inputs [start, stop - 1), targets [start + 1, stop)."""

    start: int
    stop: int
    first_scored: int
    """Index, among this window's targets, of the first one scored."""


@dataclass(frozen=True, slots=True)
class LMDocument:
    tokens: list[int]
    num_words: int
    """Megatron's num_original_tokens: space-separated words of the raw file."""


@dataclass(frozen=True, slots=True)
class ClozeExample:
    context: list[int]
    target: list[int]


def lm_windows(num_tokens: int, *, seq_length: int, stride: int) -> list[Window]:
    """Megatron _LMDataset's windows over a document of `num_tokens` tokens (see the module docstring)."""
    if not 1 <= stride <= seq_length:
        raise DataError(f"--overlapping-eval {stride} must be in [1, {seq_length}] (the model's seq_length); "
                        f"{seq_length} scores disjoint windows")
    targets = num_tokens - 1
    count = max(-(-max(targets - stride, 0) // stride) + 1, 1)
    windows = []
    for i in range(count):
        start = i * stride
        # Megatron pads a window's mask to seq_length targets and then keeps the last `stride` of them.
        first = 0 if i == 0 or stride == seq_length else seq_length - stride
        windows.append(Window(start=start, stop=min(start + seq_length + 1, num_tokens), first_scored=first))
    return windows


def _read_text(path: Path, *, flag: str, what: str) -> str:
    if not path.is_file():
        why = "is a folder" if path.is_dir() else "does not exist"
        raise DataError(f"{flag} {path} {why}; pass {what}")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise DataError(f"{path} line {line}: byte {raw[exc.start]:#04x} is not UTF-8; expected {what}") from None


def read_lm_document(path: Path, *, encode: Encode, detokenize: Callable[[str], str]) -> LMDocument:
    """The tokens and the word count of a WikiText-style file."""
    what = "a plain UTF-8 text file (WikiText-103 style, e.g. wiki.test.tokens)"
    text = _read_text(path, flag="--file", what=what)
    if text.lstrip().startswith("{"):
        raise DataError(f"{path} line 1: starts with a JSON object; --task wikitext expects {what} "
                        f"(JSON lines are for --task lambada)")
    tokens = encode(detokenize(text))
    if len(tokens) < 2:
        raise DataError(f"{path} gives {len(tokens)} token(s); perplexity needs at least 2: expected {what}")
    return LMDocument(tokens=tokens, num_words=len(text.strip().split(" ")))


def cloze_example(text: str, *, encode: Encode, strict: bool) -> ClozeExample:
    """Context and target tokens of one LAMBADA text (see the module docstring)."""
    if not strict:
        tokens = encode(text)
        return ClozeExample(context=tokens[:-1], target=tokens[-1:])
    last = text.split()[-1]
    return ClozeExample(context=encode(text[:text.rfind(last)].strip()), target=encode(" " + last))


def read_cloze_examples(path: Path, *, encode: Encode, strict: bool, seq_length: int) -> list[ClozeExample]:
    """One example per non-blank line of a LAMBADA-style JSON lines file."""
    expected = 'a JSON object with a "text" string per line, e.g. {"text": "... the last word"}'
    text = _read_text(path, flag="--file", what=f"a JSON lines file ({expected})")
    examples = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {number}: not JSON ({exc.msg}); expected {expected}") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
            raise DataError(f"{path} line {number}: no non-empty \"text\" string; expected {expected}")
        example = cloze_example(row["text"], encode=encode, strict=strict)
        if not example.context or not example.target:
            raise DataError(f"{path} line {number}: the text has no context before its last word; expected "
                            f"at least two words")
        length = len(example.context) + len(example.target)
        if length > seq_length + 1:
            raise DataError(f"{path} line {number}: {length} tokens, {length - seq_length - 1} more than the "
                            f"model's seq_length {seq_length} + 1; shorten the text")
        examples.append(example)
    if not examples:
        raise DataError(f"{path} has no examples; expected {expected}")
    return examples
