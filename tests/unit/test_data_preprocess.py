"""`preprocess` against .bin/.idx written by Megatron's tools/preprocess_data.py (tests/fixtures/preprocess)."""

from __future__ import annotations

import gzip
import io
import json
import shutil
from pathlib import Path

import pytest

from megatron_hpc.data import preprocess as preprocess_module
from megatron_hpc.data.indexed import IndexedDataset
from megatron_hpc.data.preprocess import preprocess
from megatron_hpc.errors import DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
TOKENIZER = {"vocab_file": FIXTURES / "vocab.json", "merge_file": FIXTURES / "merges.txt"}


def _same_files(ours: str, expected: str) -> None:
    for ext in (".bin", ".idx"):
        assert Path(ours + ext).read_bytes() == (FIXTURES / (expected + ext)).read_bytes(), expected + ext


@pytest.mark.parametrize("workers", [1, 2])
def test_bytes_match_megatron_with_eod_and_two_keys(tmp_path: Path, workers: int) -> None:
    result = preprocess(FIXTURES / "corpus.jsonl", output_prefix=tmp_path / "eod", json_keys=["text", "title"],
                        append_eod=True, workers=workers, progress=None, **TOKENIZER)
    assert result.prefixes == {"text": f"{tmp_path}/eod_text_document", "title": f"{tmp_path}/eod_title_document"}
    _same_files(result.prefixes["text"], "eod_text_document")
    _same_files(result.prefixes["title"], "eod_title_document")
    assert result.num_documents == 12 and not result.skipped


@pytest.mark.parametrize(("workers", "batch_lines", "batch_chars"), [(1, 1, 1 << 19), (2, 3, 1 << 19), (2, 4096, 200)])
def test_batch_boundaries_do_not_change_the_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int,
                                                   batch_lines: int, batch_chars: int) -> None:
    monkeypatch.setattr(preprocess_module, "BATCH_LINES", batch_lines)
    monkeypatch.setattr(preprocess_module, "BATCH_CHARS", batch_chars)
    result = preprocess(FIXTURES / "corpus.jsonl", output_prefix=tmp_path / "eod", json_keys=["text", "title"],
                        append_eod=True, workers=workers, progress=None, **TOKENIZER)
    _same_files(result.prefixes["text"], "eod_text_document")
    _same_files(result.prefixes["title"], "eod_title_document")
    assert result.num_documents == 12


def test_bytes_match_megatron_without_eod_from_gzip(tmp_path: Path) -> None:
    gz = tmp_path / "corpus.jsonl.gz"
    gz.write_bytes(gzip.compress((FIXTURES / "corpus.jsonl").read_bytes()))
    result = preprocess(gz, output_prefix=tmp_path / "plain", progress=None, **TOKENIZER)
    _same_files(result.prefixes["text"], "plain_text_document")


def test_megatron_semantics_visible_in_the_index(tmp_path: Path) -> None:
    result = preprocess(FIXTURES / "corpus.jsonl", output_prefix=tmp_path / "p", append_eod=True,
                        progress=None, **TOKENIZER)
    ds = IndexedDataset(result.prefixes["text"])
    docs = ds.document_indices.tolist()
    assert docs[2] == docs[3]  # document 2 is "": kept, with no sequence
    assert docs[8] - docs[7] == 3  # a list of 4 strings: the empty one is dropped, "   " is kept
    last_of_doc0 = ds[docs[1] - 1]
    assert int(last_of_doc0[-1]) == 399  # EOD = id of <|endoftext|>, the last id
    assert ds.dtype.name == "uint16" and result.num_empty == 1


def test_bad_lines_are_skipped_and_reported_by_number(tmp_path: Path) -> None:
    good = (FIXTURES / "corpus.jsonl").read_text().splitlines(keepends=True)
    lines = [*good[:3], "not json\n", "\n", '{"text": 5}\n', '["a"]\n', '{"title": "x"}\n', *good[3:]]
    src = tmp_path / "c.jsonl"
    src.write_bytes("".join(lines).encode() + b'{"text": "\xff\xfe"}\n')
    log = io.StringIO()
    result = preprocess(src, output_prefix=tmp_path / "p", json_keys=["text"], append_eod=True,
                        progress=log, **TOKENIZER)
    assert [n for n, _ in result.skipped] == [4, 5, 6, 7, 8, 18]
    reasons = dict(result.skipped)
    assert "JSON" in reasons[4] and reasons[5] == "blank line" and "int" in reasons[6]
    assert "no key 'text'" in reasons[8] and "UTF-8" in reasons[18]
    text = log.getvalue()
    assert "line 4 skipped" in text and "skipped 6 line(s): 4, 5, 6, 7, 8, 18" in text
    _same_files(result.prefixes["text"], "eod_text_document")  # skipped lines leave no trace


def test_strict_stops_at_the_first_bad_line(tmp_path: Path) -> None:
    src = tmp_path / "c.jsonl"
    shutil.copy(FIXTURES / "corpus.jsonl", src)
    with open(src, "a") as f:
        f.write("{broken\n")
    with pytest.raises(DataError, match=r"line 13: not valid JSON"):
        preprocess(src, output_prefix=tmp_path / "p", strict=True, progress=None, **TOKENIZER)
    assert not list(tmp_path.glob("p_*")), "no partial output after an error"


def test_a_key_no_line_has_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no line of .* has the key 'content'.*--json-keys"):
        preprocess(FIXTURES / "corpus.jsonl", output_prefix=tmp_path / "p", json_keys=["content"],
                   progress=None, **TOKENIZER)
    assert not list(tmp_path.glob("p_*"))


def test_progress_reports_rates_and_eta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preprocess_module, "BATCH_LINES", 64)
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"def f{i}(x): return {i}"}) + "\n" for i in range(300)))
    log = io.StringIO()
    preprocess(src, output_prefix=tmp_path / "p", progress=log, progress_interval=0.0, **TOKENIZER)
    lines = log.getvalue().splitlines()
    assert len(lines) >= 3  # one per batch of 64 lines, then the final line
    assert "docs/s" in lines[0] and "tokens/s" in lines[0] and "ETA" in lines[0] and "MiB" in lines[0]
    assert lines[-1].startswith("preprocess: 300 docs") and lines[-1].endswith("(100%), done")


def test_input_and_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        preprocess(tmp_path / "missing.jsonl", output_prefix=tmp_path / "p", progress=None, **TOKENIZER)
    with pytest.raises(DataError, match="BertWordPieceCase is not supported"):
        preprocess(FIXTURES / "corpus.jsonl", output_prefix=tmp_path / "p", tokenizer_type="BertWordPieceCase",
                   progress=None, **TOKENIZER)
    with pytest.raises(DataError, match="Llama2Tokenizer needs --tokenizer-model"):
        preprocess(FIXTURES / "corpus.jsonl", output_prefix=tmp_path / "p", tokenizer_type="Llama2Tokenizer",
                   progress=None, **TOKENIZER)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"text": "abc"}\n' * 100)[:-12])
    with pytest.raises(DataError, match="gzip"):
        preprocess(bad, output_prefix=tmp_path / "p", progress=None, **TOKENIZER)


TOKENIZER_CASES = json.loads((FIXTURES / "tokenizers" / "cases.json").read_text())["cases"]


def _case_args(case: dict, out: Path) -> list[str]:
    flags = [f.replace("{dir}", str(FIXTURES / "tokenizers")) for f in case["ours"]]
    return ["data", "preprocess", "--input", str(FIXTURES / "tokenizers" / case["input"]), "--output-prefix",
            str(out / case["name"]), *flags]


@pytest.mark.parametrize("case", TOKENIZER_CASES, ids=[c["name"] for c in TOKENIZER_CASES])
def test_bytes_match_megatron_for_each_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 case: dict) -> None:
    """Megatron-LM's tools/preprocess_data.py wrote expected/ (tests/fixtures/make_tokenizer_expected.py)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("sentencepiece")
    if "--split-sentences" in case["ours"]:
        pytest.importorskip("nltk")
        monkeypatch.setenv("NLTK_DATA", str(FIXTURES / "tokenizers" / "nltk_data"))
    from megatron_hpc.cli.main import main

    workers = ["--workers", "2"] if case["name"] in ("sp_legacy", "hf_llama") else []
    assert main([*_case_args(case, tmp_path), *workers]) == 0
    level = "sentence" if "--split-sentences" in case["ours"] else "document"
    for ext in ("bin", "idx"):
        ours = (tmp_path / f"{case['name']}_text_{level}.{ext}").read_bytes()
        assert ours == (FIXTURES / "tokenizers" / "expected" / f"{case['name']}.{ext}").read_bytes(), ext


def test_gpt_neox_hftokenizer_flags_give_the_folder_bytes(tmp_path: Path) -> None:
    """GPT-NeoX's `--tokenizer-type HFTokenizer --vocab-file tokenizer.json`: that folder's tokenizer adds no
    special tokens and its EOD is <|endoftext|>, so the bytes are Megatron's for the folder."""
    pytest.importorskip("tokenizers")
    from megatron_hpc.cli.main import main

    folder = FIXTURES / "tokenizers"
    assert main(["data", "preprocess", "--input", str(folder / "corpus.jsonl"), "--output-prefix", str(tmp_path / "n"),
                 "--tokenizer-type", "HFTokenizer", "--vocab-file", str(folder / "neox" / "tokenizer.json"),
                 "--append-eod"]) == 0
    for ext in ("bin", "idx"):
        expected = (folder / "expected" / f"hf_neox.{ext}").read_bytes()
        assert (tmp_path / f"n_text_document.{ext}").read_bytes() == expected


def test_split_sentences_without_nltk_or_its_data_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys) -> None:
    import sys

    from megatron_hpc.cli.main import main

    args = ["data", "preprocess", "--input", str(FIXTURES / "corpus.jsonl"), "--output-prefix", str(tmp_path / "p"),
            "--vocab-file", str(TOKENIZER["vocab_file"]), "--merge-file", str(TOKENIZER["merge_file"]),
            "--split-sentences"]
    pytest.importorskip("nltk")
    assert main([*args, "--lang", "nosuchlanguage"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megatron-hpc: error: --split-sentences needs nltk's punkt data for 'nosuchlanguage', which is "
                   "not installed; pip install nltk && python -m nltk.downloader punkt_tab (or set NLTK_DATA to a "
                   "folder holding tokenizers/punkt_tab/nosuchlanguage)"]
    monkeypatch.setitem(sys.modules, "nltk", None)  # as if nltk were not installed: `import nltk` fails
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megatron-hpc: error: --split-sentences needs nltk and its punkt_tab data; pip install nltk && "
                   "python -m nltk.downloader punkt_tab"]
    assert not list(tmp_path.iterdir())
