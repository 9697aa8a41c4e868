"""The word-caching encoder (fast_encode.py) against the `tokenizers` pipeline it stands in for: same words, same ids.

Expected values come from `tokenizers` itself (Tokenizer.encode, the ByteLevel pre-tokenizer), never from the code
under test.
"""

from __future__ import annotations

import itertools
import json
import random
import string
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from megatron_hpc.data import fast_encode
from megatron_hpc.data.fast_encode import CharClasses
from megatron_hpc.data.tokenizer import GPT2BPETokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
TRICKY = [
    "", " ", "  ", "\n", "a  b", "a \n b", "x   \n\n  y", "trailing   ", "   leading", "tab\there\t\t x",
    "it's I'm we'll they've you'd 'S 're 'sx", " 'll '", "3.14159 12345678901234 \u0663\u0664 \u00b2\u00b3 \u216b",
    "\u00a0nbsp\u00a0 x", "\x1c\x1d\x1e\x1f separators", "x\x1c\x1cy !\x1f\x85?", "\x85nel\x85",
    "\u3000ideographic\u3000 space",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u65e5\u672c\u8a9e \U0001f600 \u0394x", "e\u0301 combining \u0915\u093f",
    "\U0001d400\U0001d401 \U0001d7ce math", "\U00020000\U00020001 ext-b", "\u2028line\u2029para",
    "a<|endoftext|>b", "<|endoftext|><|endoftext|>", " <|endoftext|> ", "<|endoftext", "endoftext|>",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0645\u0631\u062d\u0628\u0627",
]


@pytest.fixture(scope="module")
def tok() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(FIXTURES / "vocab.json", FIXTURES / "merges.txt")


def _reference(tok: GPT2BPETokenizer, texts: list[str], dtype: type[np.generic] = np.uint16) -> list[bytes]:
    return [np.asarray(tok.encode(t), dtype=dtype).tobytes() for t in texts]


def _word_ends(text: str) -> list[int]:
    """Where tokenizers' words end: the special token is cut out first (added vocabulary), then the ByteLevel
    pre-tokenizer cuts each piece."""
    pre = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ends: list[int] = []
    start = 0
    for i, piece in enumerate(text.split("<|endoftext|>")):
        if i:
            start += len("<|endoftext|>")
            ends.append(start)
        ends += [start + end for _, (_, end) in pre.pre_tokenize_str(piece)]
        start += len(piece)
    return ends


def test_ascii_classes_are_the_engines() -> None:
    members = CharClasses(tokenizers).engine_members("".join(map(chr, range(128))))
    assert members == {"L": set(map(ord, string.ascii_letters)), "N": set(map(ord, string.digits)),
                       "S": {9, 10, 11, 12, 13, 32}}


def test_tricky_texts_give_the_same_ids(tok: GPT2BPETokenizer) -> None:
    want = _reference(tok, TRICKY)
    encoder = tok.fast_encoder(np.uint16)
    assert encoder.encode(TRICKY) == want
    for text in TRICKY:  # ids alone could hide a wrong cut where no merge spans it
        assert list(itertools.accumulate(map(len, encoder.words(text)))) == _word_ends(text), repr(text)
    one_at_a_time = tok.fast_encoder(np.uint16)  # new character blocks arrive batch after batch
    assert [one_at_a_time.encode([t])[0] for t in TRICKY] == want
    assert tok.fast_encoder(np.int32).encode(TRICKY) == _reference(tok, TRICKY, np.int32)


def test_corpus_and_probe_texts_give_the_same_ids(tok: GPT2BPETokenizer) -> None:
    texts = json.loads((FIXTURES / "probes.json").read_text())["texts"]
    for line in (FIXTURES / "corpus.jsonl").read_text().splitlines():
        value = json.loads(line)["text"]
        texts += value if isinstance(value, list) else [value]
    assert tok.fast_encoder(np.uint16).encode(texts) == _reference(tok, texts)


def test_every_code_point_is_cut_and_encoded_as_tokenizers_does(tok: GPT2BPETokenizer) -> None:
    """The whole BMP and samples of the other planes, each in a random context."""
    rng = random.Random(0)
    points = [c for c in range(0x10000) if not 0xD800 <= c < 0xE000]
    points += rng.sample(range(0x10000, 0x40000), 3000) + rng.sample(range(0xE0000, 0xE1000), 200)
    points += rng.sample(range(0x40000, 0x110000), 30)
    rng.shuffle(points)
    contexts = ["", " ", "a", "1", "'s", "  ", "\n", "!", " \u00a0", "\t ", "<|endoftext|>"]
    text = "".join(chr(c) + rng.choice(contexts) for c in points)
    encoder = tok.fast_encoder(np.uint16)
    assert list(itertools.accumulate(map(len, encoder.words(text)))) == _word_ends(text)
    assert encoder.encode([text]) == _reference(tok, [text])


def test_a_full_cache_starts_over_without_changing_ids(tok: GPT2BPETokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_encode, "MAX_CACHED_WORDS", 3)
    encoder = tok.fast_encoder(np.uint16)
    want = _reference(tok, TRICKY)
    for _ in range(2):
        assert [b for i in range(0, len(TRICKY), 4) for b in encoder.encode(TRICKY[i:i + 4])] == want
