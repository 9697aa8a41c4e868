"""GPT-2 BPE: ids against Megatron's own tokenizer (tests/fixtures/preprocess/probes.json), training output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_hpc.data.tokenizer import EOD_TOKEN, GPT2BPETokenizer, train_tokenizer
from megatron_hpc.errors import DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"


@pytest.fixture(scope="module")
def tok() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(FIXTURES / "vocab.json", FIXTURES / "merges.txt")


def test_ids_match_megatron_gpt2_tokenizer(tok: GPT2BPETokenizer) -> None:
    probes = json.loads((FIXTURES / "probes.json").read_text())
    for text, legacy in zip(probes["texts"], probes["legacy_ids"]):
        if EOD_TOKEN not in text:  # both Megatron paths agree here
            assert tok.encode(text) == legacy, text
    assert tok.encode_batch(probes["texts"][:2]) == probes["legacy_ids"][:2]


def test_literal_eod_is_the_special_token_as_in_megatron_default_path(tok: GPT2BPETokenizer) -> None:
    probes = json.loads((FIXTURES / "probes.json").read_text())
    text = "a<|endoftext|>b"
    index = probes["texts"].index(text)
    if "hf_fast_ids" in probes:
        assert tok.encode(text) == probes["hf_fast_ids"][index]
    assert tok.encode(text) == [tok.encode("a")[0], tok.eod, tok.encode("b")[0]]
    assert tok.encode(text) != probes["legacy_ids"][index]  # --legacy-tokenizer splits the literal


def test_decode_round_trips(tok: GPT2BPETokenizer) -> None:
    for text in ["def f(x):\n\treturn x  # caf\u00e9 \U0001f600", "   ", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.eod]) == EOD_TOKEN


def test_trained_files_are_gpt2_format_with_eod_last(tmp_path: Path) -> None:
    corpus = [Path(json.__file__).with_name(n) for n in ("decoder.py", "encoder.py")]  # real text, ~25 KB
    vocab_path, merges_path = train_tokenizer(corpus, vocab_size=300, output_dir=tmp_path / "t")
    vocab = json.loads(vocab_path.read_text())
    merges = merges_path.read_text()
    assert sorted(vocab.values()) == list(range(len(vocab))) and len(vocab) == 300
    assert vocab[EOD_TOKEN] == 299
    assert merges.startswith("#version: 0.2\n") and merges.endswith("\n")
    lines = merges.splitlines()[1:]
    assert len(lines) == 300 - 256 - 1 and all(len(x.split(" ")) == 2 for x in lines)
    assert len([t for t, i in vocab.items() if i < 256]) == 256  # the byte alphabet comes first
    again = train_tokenizer(corpus, vocab_size=300, output_dir=tmp_path / "t2")
    assert again[0].read_bytes() == vocab_path.read_bytes() and again[1].read_bytes() == merges_path.read_bytes()
    tok = GPT2BPETokenizer(vocab_path, merges_path)
    assert tok.vocab_size == 300 and tok.eod == 299
    assert len(tok.encode("    def decode(self, s):")) < len("    def decode(self, s):")  # merges were learned


def test_trains_on_jsonl_text_key(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": "zzyzx zzyzx", "other": "qqqq"}) + "\n" for _ in range(30)))
    vocab_path, _ = train_tokenizer([corpus], vocab_size=270, output_dir=tmp_path)
    vocab = json.loads(vocab_path.read_text())
    assert "zz" in vocab and "qq" not in vocab


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="too small"):
        train_tokenizer([FIXTURES / "corpus.jsonl"], vocab_size=200, output_dir=tmp_path)
    with pytest.raises(DataError, match=r"vocab file .* not found"):
        GPT2BPETokenizer(tmp_path / "none.json", FIXTURES / "merges.txt")
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, "b": 1}))
    (tmp_path / "m.txt").write_text("#version: 0.2\na b\n")
    with pytest.raises(DataError, match="do not belong together"):
        GPT2BPETokenizer(tmp_path / "v.json", tmp_path / "m.txt")
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    with pytest.raises(DataError, match="no <\\|endoftext\\|>"):
        GPT2BPETokenizer(tmp_path / "v.json", tmp_path / "m.txt").eod  # noqa: B018
