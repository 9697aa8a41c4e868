"""`megatron-hpc data ...` end to end through cli.main (results on stdout, errors as one line, exit 1)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

import megatron_hpc.data.demo_corpus as demo_corpus
from megatron_hpc.cli.data_cmd import DEMO_VOCAB_SIZE, demo_paths
from megatron_hpc.cli.main import main
from megatron_hpc.data.indexed import IndexedDataset

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
TOK = ["--vocab-file", str(FIXTURES / "vocab.json"), "--merge-file", str(FIXTURES / "merges.txt")]


def test_preprocess_prints_prefixes_and_matches_megatron(tmp_path: Path, capsys) -> None:
    rc = main(["data", "preprocess", "--input", str(FIXTURES / "corpus.jsonl"), "--output-prefix",
               str(tmp_path / "eod"), "--tokenizer-type", "GPT2BPETokenizer", *TOK, "--append-eod",
               "--json-keys", "text", "title", "--workers", "2"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.split() == [f"{tmp_path}/eod_text_document", f"{tmp_path}/eod_title_document"]
    assert "docs/s" in err and "tokens/s" in err
    for name in ("eod_text_document.bin", "eod_text_document.idx", "eod_title_document.idx"):
        assert (tmp_path / name).read_bytes() == (FIXTURES / name).read_bytes()


def test_preprocess_strict_error_is_one_line(tmp_path: Path, capsys) -> None:
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "ok"}\nnope\n')
    rc = main(["data", "preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "p"), *TOK, "--strict"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("megatron-hpc: error: line 2: not valid JSON")


def test_inspect_text_and_json(capsys) -> None:
    prefix = str(FIXTURES / "eod_text_document")
    assert main(["data", "inspect", prefix, *TOK]) == 0
    text = capsys.readouterr().out
    assert "sequences  13" in text and "documents  12" in text and "dtype      uint16" in text
    assert "peek       'def add(a, b):" in text
    assert main(["data", "inspect", prefix, "--json", *TOK]) == 0
    info = json.loads(capsys.readouterr().out)
    ds = IndexedDataset(prefix)
    assert {k: info[k] for k in ("sequences", "documents", "tokens", "dtype")} == {
        "sequences": 13, "documents": 12, "tokens": ds.num_tokens, "dtype": "uint16"}
    assert info["peek"] == 'def add(a, b):\n    """Return a + b."""\n    return a + b\n<|endoftext|>'
    assert main(["data", "inspect", prefix, "--json"]) == 0
    assert "peek" not in json.loads(capsys.readouterr().out)


def test_inspect_missing_dataset_exits_1(tmp_path: Path, capsys) -> None:
    assert main(["data", "inspect", str(tmp_path / "none")]) == 1
    assert capsys.readouterr().err.startswith("megatron-hpc: error: ")


def test_train_tokenizer_writes_both_files(tmp_path: Path, capsys) -> None:
    assert main(["data", "train-tokenizer", "--input", str(FIXTURES / "corpus.jsonl"), "--vocab-size", "300",
                 "--output-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")]
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert vocab["<|endoftext|>"] == max(vocab.values())


def test_demo_builds_once_then_is_a_no_op(tmp_path: Path, capsys, monkeypatch) -> None:
    capped = functools.partial(demo_corpus.write_demo_corpus, max_bytes=300_000)
    monkeypatch.setattr(demo_corpus, "write_demo_corpus", capped)
    out = tmp_path / "demo"
    assert main(["data", "demo", "--out", str(out)]) == 0
    prefix = capsys.readouterr().out.strip()
    assert prefix == str(demo_paths(out)["prefix"]) == f"{out}/stdlib_text_document"
    ds = IndexedDataset(prefix)
    vocab = json.loads((out / "vocab.json").read_text())
    assert len(vocab) == DEMO_VOCAB_SIZE == 8192 and vocab["<|endoftext|>"] == 8191
    lines = (out / "stdlib.jsonl").read_text().splitlines()
    assert ds.num_documents == len(lines) > 10
    assert all(int(ds[i][-1]) == 8191 for i in range(len(ds)))  # --append-eod
    assert json.loads(lines[0])["path"].startswith("Lib/")
    mtime = Path(prefix + ".bin").stat().st_mtime_ns
    assert main(["data", "demo", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == prefix and "nothing to do" in captured.err
    assert Path(prefix + ".bin").stat().st_mtime_ns == mtime


def test_demo_corpus_is_deterministic_and_capped(tmp_path: Path) -> None:
    a = demo_corpus.write_demo_corpus(tmp_path / "a.jsonl", max_bytes=100_000, max_file_bytes=20_000)
    b = demo_corpus.write_demo_corpus(tmp_path / "b.jsonl", max_bytes=100_000, max_file_bytes=20_000)
    assert a == b and a[1] <= 100_000
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    paths = [json.loads(x)["path"] for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert paths == sorted(paths) and not any("/test/" in p for p in paths)


def test_samples_passes_arguments_and_prints_json(monkeypatch, capsys) -> None:
    import megatron_hpc.data.loader as loader

    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return [{"index": 7, "tokens": np.array([1, 2]), "labels": np.array([2, 3]), "loss_mask": np.ones(2)}]

    monkeypatch.setattr(loader, "gpt_samples", fake)
    assert main(["data", "samples", "--data-path", "P", "--seq-length", "2", "--seed", "1234", "--split",
                 "969,30,1", "--split-name", "valid", "--start", "7", "--count", "1", "--num-samples", "10",
                 "--data-cache-path", "C", "--json"]) == 0
    assert seen == {"data_path": "P", "seq_length": 2, "seed": 1234, "split": "969,30,1", "split_name": "valid",
                    "num_samples": 10, "start": 7, "count": 1, "cache_path": "C"}
    assert json.loads(capsys.readouterr().out) == {"index": 7, "tokens": [1, 2], "labels": [2, 3],
                                                   "loss_mask": [1.0, 1.0]}


def test_samples_on_real_data(tmp_path: Path, capsys) -> None:
    prefix = str(FIXTURES / "eod_text_document")
    assert main(["data", "samples", "--data-path", prefix, "--seq-length", "8", "--split", "1,0,0", "--start", "0",
                 "--count", "2", "--data-cache-path", str(tmp_path), "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    assert all(len(r["tokens"]) == 8 and r["tokens"][1:] == r["labels"][:-1] for r in rows)


def test_inspect_decodes_with_any_tokenizer(capsys) -> None:
    folder = FIXTURES / "tokenizers"
    sp = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(folder / "sp_bpe.model")]
    assert main(["data", "inspect", str(folder / "expected" / "sp"), "--json", *sp]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["peek"].startswith('def add(a, b):\n    """Return a + b."""')
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder / "neox")]
    assert main(["data", "inspect", str(folder / "expected" / "hf_neox"), "--json", *hf]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["peek"] == 'def add(a, b):\n    """Return a + b."""\n    return a + b\n<|endoftext|>'
