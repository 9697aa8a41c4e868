r"""Exact GPT-2 byte-level BPE ids, fast: GPT-2's pre-tokenizer regex in Python's `re` plus a word -> ids cache.

Why: in the `tokenizers` pipeline most of the time goes to per-word bookkeeping (a NormalizedString with byte
alignments per word, a Token with its string and offsets per id), not to BPE merges. But the ids of a text only
depend on its words. The byte-level pre-tokenizer (tokenizers `pre_tokenizers/byte_level.rs`) cuts the text with

    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

and BPE encodes every word on its own. So `WordCacheEncoder` cuts the text with the same pattern in Python's `re`
(a backtracking engine with the same leftmost-first alternation as the Oniguruma engine tokenizers uses), looks
each word up in a dict, and sends only words it has not seen yet through `tokenizers` (byte-level BPE on the
word, no regex). Special tokens (`<|endoftext|>`) are cut out first, as tokenizers' added vocabulary does.

The two regex engines could only disagree on which characters `\p{L}`, `\p{N}` and `\s` match: Python's `\s` is
not Oniguruma's (U+001C-U+001F), and Unicode tables differ between versions. So the classes do not come from
Python: characters are classified by the tokenizers regex engine itself, 4096 code points at a time, the first
time a text holds one of them, and the pattern is recompiled with what was learned. The result is the ids of
`Tokenizer.encode` for every text: tests/unit/test_data_fast_encode.py compares the cuts and ids for the whole BMP
and samples of the other planes (a one-off run over all 1,112,064 code points agreed too).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

_CLASSES = {"L": r"\p{L}", "N": r"\p{N}", "S": r"\s"}
_ASCII_CLASSES = {"L": "A-Za-z", "N": "0-9", "S": r"\t\n\x0b\x0c\r\x20"}
"""What Oniguruma's \\p{L}, \\p{N} and \\s match below U+0080 (checked against the engine by the tests)."""
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
_SURROGATES = range(0xD800, 0xE000)
MAX_CACHED_WORDS = 1 << 19
MAX_CACHED_CHARS = 1 << 25
"""Bounds on the word cache of one process (under about 100 MB); it starts over when either is passed."""


def _class_text(code_points: Sequence[int]) -> str:
    """A regex character-class body (no brackets) for sorted code points, as ranges."""
    parts = []
    for _, group in itertools.groupby(enumerate(code_points), key=lambda ic: ic[1] - ic[0]):
        run = [cp for _, cp in group]
        first, last = re.escape(chr(run[0])), re.escape(chr(run[-1]))
        parts.append(first if len(run) == 1 else f"{first}-{last}")
    return "".join(parts)


def _gpt2_pattern(letters: str, numbers: str, spaces: str) -> re.Pattern[str]:
    """GPT-2's pre-tokenizer pattern for the given class bodies (\\p{L}, \\p{N}, \\s)."""
    letter, number, space = f"[{letters}]", f"[{numbers}]", f"[{spaces}]"
    other = f"[^{spaces}{letters}{numbers}]"
    non_space = f"[^{spaces}]"
    return re.compile(f"'s|'t|'re|'ve|'m|'ll|'d| ?{letter}+| ?{number}+| ?{other}+|{space}+(?!{non_space})|{space}+")


class CharClasses:
    """\\p{L}, \\p{N} and \\s as the `tokenizers` regex engine sees them, learned 4096 code points at a time."""

    UNIT_BITS = 12

    def __init__(self, tokenizers_module: Any):
        self._tk = tokenizers_module
        self.members: dict[str, set[int]] = {name: set() for name in _CLASSES}
        """Non-ASCII code points of each class, in the units learned so far."""
        self.units: set[int] = set()
        self._learn(0)  # U+0000-U+0FFF: ASCII is fixed (_ASCII_CLASSES), the rest comes from the engine
        self._unknown = self._unknown_pattern()

    def engine_members(self, text: str) -> dict[str, set[int]]:
        """Code points of `text` (no surrogates) that the engine's \\p{L}, \\p{N} and \\s match."""
        out = {}
        for name, rx in _CLASSES.items():
            splitter = self._tk.pre_tokenizers.Split(self._tk.Regex(rx), behavior="removed")
            kept = splitter.pre_tokenize_str(text)  # the runs that do not match, with char offsets
            matched = set(range(len(text)))
            for _, (start, end) in kept:
                matched.difference_update(range(start, end))
            out[name] = {ord(text[i]) for i in matched}
        return out

    def _learn(self, unit: int) -> None:
        first = unit << self.UNIT_BITS
        text = "".join(chr(cp) for cp in range(first, first + (1 << self.UNIT_BITS)) if cp not in _SURROGATES)
        if text:  # surrogates never reach the tokenizer: there is nothing to classify
            for name, members in self.engine_members(text).items():
                self.members[name].update(cp for cp in members if cp >= 0x80)
        self.units.add(unit)

    def _unknown_pattern(self) -> re.Pattern[str]:
        """Matches a character of a unit not learned yet."""
        ranges = []
        for _, group in itertools.groupby(enumerate(sorted(self.units)), key=lambda iu: iu[1] - iu[0]):
            run = [u for _, u in group]
            first, last = run[0] << self.UNIT_BITS, ((run[-1] + 1) << self.UNIT_BITS) - 1
            ranges.append(f"{re.escape(chr(first))}-{re.escape(chr(last))}")
        return re.compile(f"[^{''.join(ranges)}]")

    def learn(self, texts: Iterable[str]) -> bool:
        """Classify the characters of `texts` not seen before; True if there were any."""
        new: set[int] = set()
        for text in texts:
            if self._unknown.search(text) is not None:
                new.update(ord(c) >> self.UNIT_BITS for c in set(text))
        new -= self.units
        for unit in sorted(new):
            self._learn(unit)
        if new:
            self._unknown = self._unknown_pattern()
        return bool(new)

    def pattern(self, *, astral: bool) -> re.Pattern[str]:
        """The GPT-2 pattern with the learned classes; `astral=False` leaves out code points above U+FFFF, which
        keeps `re`'s class tests to one table lookup for texts that have none."""
        bodies = []
        for name in _CLASSES:
            points = sorted(cp for cp in self.members[name] if astral or cp <= 0xFFFF)
            bodies.append(_ASCII_CLASSES[name] + _class_text(points))
        return _gpt2_pattern(*bodies)


class WordCacheEncoder:
    """Token ids of texts as `bytes` of one dtype, the same ids as `tokenizer.encode(text).ids`.

    `word_tokenizer` is the same BPE model behind a byte-level pre-tokenizer without regex (one word in, its ids
    out); `special` maps special-token strings (cut out before the regex) to their ids.
    """

    def __init__(self, word_tokenizer: Any, *, tokenizers_module: Any, dtype: np.dtype, special: dict[str, int]):
        self._word_tok = word_tokenizer
        self._encode_words = getattr(word_tokenizer, "encode_batch_fast", word_tokenizer.encode_batch)
        self.dtype = np.dtype(dtype)
        self._special = {token: np.asarray([i], dtype=self.dtype).tobytes() for token, i in special.items()}
        self._special_rx = re.compile("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True)))
        self._classes = CharClasses(tokenizers_module)
        self._ascii = _gpt2_pattern(*_ASCII_CLASSES.values())
        self._bmp: re.Pattern[str] | None = None
        self._full: re.Pattern[str] | None = None
        self._cache = _WordCache(self._special)
        self._cached_chars = 0

    def _learn(self, texts: Sequence[str]) -> None:
        non_ascii = [t for t in texts if not t.isascii()]  # isascii() is O(1) in CPython
        if non_ascii and self._classes.learn(non_ascii):
            self._bmp = self._full = None

    def _words(self, text: str) -> list[str]:
        """`text` cut by the GPT-2 pattern; its characters must have been learned."""
        if text.isascii():
            return self._ascii.findall(text)
        if _ASTRAL.search(text) is None:
            if self._bmp is None:
                self._bmp = self._classes.pattern(astral=False)
            return self._bmp.findall(text)
        if self._full is None:
            self._full = self._classes.pattern(astral=True)
        return self._full.findall(text)

    def words(self, text: str) -> list[str]:
        """`text` cut into GPT-2 words; a special token is one word of its own."""
        self._learn([text])
        return self._split(text)

    def _split(self, text: str) -> list[str]:
        if not self._special or not self._special_rx.search(text):
            return self._words(text)
        out: list[str] = []
        start = 0
        for match in self._special_rx.finditer(text):
            out += self._words(text[start:match.start()])
            out.append(match.group())
            start = match.end()
        return out + self._words(text[start:])

    def _fill(self, words: set[str]) -> None:
        ordered = list(words)
        for word, encoding in zip(ordered, self._encode_words(ordered, add_special_tokens=False)):
            self._cache[word] = np.asarray(encoding.ids, dtype=self.dtype).tobytes()
        self._cached_chars += sum(map(len, ordered))

    def encode(self, texts: Sequence[str]) -> list[bytes]:
        """The ids of every text, as native-endian bytes of `dtype`."""
        self._learn(texts)
        split = [self._split(t) for t in texts]
        cache = self._cache
        if len(cache) > MAX_CACHED_WORDS or self._cached_chars > MAX_CACHED_CHARS:
            cache.clear()  # start over rather than grow without bound
            cache.update(self._special)
            self._cached_chars = 0
        # One pass with what is cached; a text with an unknown word is redone once its words are encoded.
        get = cache.__getitem__
        out, redo = [], []
        for i, words in enumerate(split):
            misses = cache.misses
            out.append(b"".join(map(get, words)))
            if cache.misses != misses:
                redo.append(i)
        if redo:
            self._fill(cache.missing)
            cache.missing = set()
            for i in redo:
                out[i] = b"".join(map(get, split[i]))
        return out


class _WordCache(dict):
    """word -> token bytes. Looking up an unknown word gives b"" and records it (`missing`, `misses`)."""

    def __init__(self, entries: dict[str, bytes]):
        super().__init__(entries)
        self.missing: set[str] = set()
        self.misses = 0

    def __missing__(self, word: str) -> bytes:
        self.missing.add(word)
        self.misses += 1
        return b""
