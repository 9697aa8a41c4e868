"""Hugging Face and SentencePiece tokenizers against their own libraries and transformers, on tiny tokenizers
trained here (nothing downloads). Megatron's own output for them: test_data_preprocess.py's fixture cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_hpc.data.hf_tokenizer import HuggingFaceTokenizer
from megatron_hpc.data.sp_tokenizer import SentencePieceTokenizer
from megatron_hpc.data.text_tokenizers import build_tokenizer, tokenizer_spec
from megatron_hpc.errors import DataError

tokenizers = pytest.importorskip("tokenizers")
sentencepiece = pytest.importorskip("sentencepiece")

TEXTS = ["def f(x):\n    return x * 2\n", "It's what we'll do, isn't it?",
         "caf\u00e9 na\u00efve \u65e5\u672c \U0001f600", "   leading and trailing   ", "a<|endoftext|>b", "",
         "x  y\t\tz\n\n"]
CORPUS = [*TEXTS, "The quick brown fox jumps over the lazy dog. " * 5, "for i in range(10): print(i)\n" * 5]


def _neox_folder(root: Path, *, config: dict | None = None) -> Path:
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, tk.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|padding|>"], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def _llama_folder(root: Path) -> Path:
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = tk.normalizers.Sequence([tk.normalizers.Prepend("\u2581"), tk.normalizers.Replace(" ", "\u2581")])
    tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("\u2581", " "), tk.decoders.ByteFallback(),
                                        tk.decoders.Fuse(), tk.decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, tk.trainers.BpeTrainer(
        vocab_size=360, show_progress=False, special_tokens=["<unk>", "<s>", "</s>",
                                                             *(f"<0x{i:02X}>" for i in range(256))]))
    tok.post_processor = tk.processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", tok.token_to_id("<s>"))])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    # The generic class: transformers 4 and 5 both run tokenizer.json as it is (5 rebuilds a LlamaTokenizer's
    # pipeline from the class; Megatron's fixture, made with 4.x, covers that class).
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return root


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sp")
    (root / "train.txt").write_text("\n".join(CORPUS * 3))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "train.txt"), model_prefix=str(root / "m"),
                                             vocab_size=360, model_type="bpe", byte_fallback=True,
                                             character_coverage=1.0, minloglevel=2)
    return root / "m.model"


@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_hf_folder_ids_eod_and_size_match_transformers(tmp_path: Path, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    eot = "<|endoftext|>"
    folder = (_neox_folder(tmp_path / kind, config={"tokenizer_class": "GPTNeoXTokenizer", "eos_token": eot,
                                                    "bos_token": eot}) if kind == "neox"
              else _llama_folder(tmp_path / kind))
    ours = HuggingFaceTokenizer(folder)
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ours.encode(text) == reference(text).input_ids, text
    assert ours.eod == reference.eos_token_id is not None
    assert ours.vocab_size == len(reference)
    if kind == "llama":
        assert ours.encode("hi")[0] == reference.bos_token_id  # its tokenizer.json adds BOS
        without = HuggingFaceTokenizer(folder, special_tokens=False)
        assert without.encode("hi") == reference("hi", add_special_tokens=False).input_ids
    assert ours.decode(ours.encode("for i in range(3)")).endswith("for i in range(3)")


def test_a_bare_tokenizer_json_is_gpt_neox_hftokenizer(tmp_path: Path) -> None:
    path = _neox_folder(tmp_path / "neox") / "tokenizer.json"
    library = tokenizers.Tokenizer.from_file(str(path))
    spec = tokenizer_spec("HFTokenizer", vocab_file=path)  # GPT-NeoX's spelling
    assert spec.type == "HuggingFaceTokenizer" and spec.model == str(path) and spec.vocab_file is None
    ours = build_tokenizer(spec)
    assert ours.eod == library.token_to_id("<|endoftext|>")
    assert [ours.encode(t) for t in TEXTS] == [library.encode(t).ids for t in TEXTS]
    assert ours.vocab_size == library.get_vocab_size()


def test_special_tokens_map_wins_and_a_missing_eos_is_an_error(tmp_path: Path) -> None:
    folder = _neox_folder(tmp_path / "a", config={"tokenizer_class": "PreTrainedTokenizerFast",
                                                   "eos_token": "<|padding|>"})
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    tok = HuggingFaceTokenizer(folder)
    assert tok.eod == tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|endoftext|>")
    bare = _neox_folder(tmp_path / "b", config={"tokenizer_class": "PreTrainedTokenizerFast"})
    with pytest.raises(DataError, match=r"names no eos_token.*tokenizer_config.json"):
        HuggingFaceTokenizer(bare).eod  # noqa: B018
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"has no tokenizer.json"):
        HuggingFaceTokenizer(tmp_path / "empty")
    with pytest.raises(DataError, match=r"not found"):
        HuggingFaceTokenizer(tmp_path / "nowhere")


def test_add_bos_token_rebuilds_the_post_processor_as_transformers_4_does(tmp_path: Path) -> None:
    folder = _neox_folder(tmp_path / "n", config={"tokenizer_class": "GPTNeoXTokenizer", "bos_token": "<|padding|>",
                                                   "eos_token": "<|endoftext|>", "add_bos_token": True,
                                                   "add_eos_token": True})
    tok = HuggingFaceTokenizer(folder)
    plain = HuggingFaceTokenizer(folder, special_tokens=False).encode("hello")
    library = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.encode("hello") == [library.token_to_id("<|padding|>"), *plain, library.token_to_id("<|endoftext|>")]


def test_sentencepiece_default_is_the_model_itself(sp_model: Path) -> None:
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tok = SentencePieceTokenizer(sp_model, kind=kind)
        assert [tok.encode(t) for t in TEXTS] == [processor.encode_as_ids(t) for t in TEXTS], kind
        assert tok.eod == processor.eos_id() and tok.vocab_size == processor.get_piece_size()
    assert tok.decode(tok.encode("def f(x):")) == processor.decode_ids(processor.encode_as_ids("def f(x):"))


def test_sentencepiece_legacy_types(sp_model: Path) -> None:
    processor = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    pieces = processor.get_piece_size()
    llama = SentencePieceTokenizer(sp_model, kind="Llama2Tokenizer", legacy=True)
    assert llama.encode("hello there") == [processor.bos_id(), *processor.encode_as_ids("hello there")]
    assert llama.eod == processor.eos_id() and llama.vocab_size == pieces
    legacy = SentencePieceTokenizer(sp_model, kind="SentencePieceTokenizer", legacy=True)
    # <CLS> <SEP> <EOD> <MASK> <PAD> are new ids after the pieces; <s> and </s> are the model's own.
    assert legacy.vocab_size == pieces + 5 and legacy.eod == pieces + 2
    text = "x<EOD>y </s><MASK>"
    assert legacy.encode(text) == [*processor.encode_as_ids("x"), pieces + 2, *processor.encode_as_ids("y "),
                                   processor.eos_id(), pieces + 3]
    assert legacy.decode(legacy.encode("ab<SEP>cd")) == "ab<SEP>cd"


def test_spec_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"BertWordPieceLowerCase is not supported; use one of GPT2BPETokenizer"):
        tokenizer_spec("BertWordPieceLowerCase", vocab_file="v.txt")
    with pytest.raises(DataError, match=r"needs --vocab-file .* and --merge-file"):
        tokenizer_spec("GPT2BPETokenizer", vocab_file="v.json")
    with pytest.raises(DataError, match=r"HuggingFaceTokenizer needs --tokenizer-model"):
        tokenizer_spec("HuggingFaceTokenizer")
    with pytest.raises(DataError, match=r"Llama2Tokenizer needs --tokenizer-model"):
        tokenizer_spec("Llama2Tokenizer")
    with pytest.raises(DataError, match=r"not found; pass the SentencePiece .model"):
        build_tokenizer(tokenizer_spec("Llama2Tokenizer", model=tmp_path / "none.model"))
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match=r"not a SentencePiece model"):
        build_tokenizer(tokenizer_spec("SentencePieceTokenizer", model=tmp_path / "bad.model"))
