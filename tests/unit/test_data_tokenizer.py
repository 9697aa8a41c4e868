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


def test_saved_hf_folder_gives_megatrons_ids_in_transformers(tok: GPT2BPETokenizer, tmp_path: Path) -> None:
    """The real transformers loads what save_hf writes and matches Megatron's default (HF fast) path, whose ids
    tests/fixtures/preprocess/probes.json holds, the literal <|endoftext|> included."""
    import transformers

    tok.save_hf(tmp_path, model_max_length=64)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    probes = json.loads((FIXTURES / "probes.json").read_text())
    assert [hf(text)["input_ids"] for text in probes["texts"]] == probes["hf_fast_ids"]
    assert (hf.eos_token, hf.eos_token_id, hf.model_max_length, len(hf)) == (EOD_TOKEN, tok.eod, 64, 400)


def test_saved_hf_folder_without_eod_names_no_special_token(tmp_path: Path) -> None:
    """Naming <|endoftext|> when the vocabulary lacks it would make transformers add an id the model lacks."""
    import transformers

    vocab = json.loads((FIXTURES / "vocab.json").read_text())
    del vocab[EOD_TOKEN]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "vocab.json").write_text(json.dumps(vocab))
    no_eod = GPT2BPETokenizer(tmp_path / "src" / "vocab.json", FIXTURES / "merges.txt")
    no_eod.save_hf(tmp_path / "hf", model_max_length=64)
    assert json.loads((tmp_path / "hf" / "special_tokens_map.json").read_text()) == {}
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert len(hf) == len(vocab) and hf.eos_token_id is None
    assert hf("def f(x): return x")["input_ids"] == no_eod.encode("def f(x): return x")
