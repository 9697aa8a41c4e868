"""The tutorials' preprocess_data.py command lines, pasted verbatim after `megatron-hpc data preprocess`.

Only the file paths are swapped (for the fixtures); every flag stays as published. Where Megatron-LM's own
output for the same input and tokenizer is in tests/fixtures, the bytes are compared too.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from megatron_hpc.cli.main import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
TOKENIZERS = FIXTURES / "tokenizers"

# (where it is published, the command as published, path -> fixture, expected output -> fixture prefix)
TUTORIALS = [
    ("Megatron-LM README, GPT data (2020-2023; the Neuron reference's README_ORIGINAL.md)", """
python tools/preprocess_data.py \\
       --input my-corpus.json \\
       --output-prefix my-gpt2 \\
       --vocab gpt2-vocab.json \\
       --dataset-impl mmap \\
       --tokenizer-type GPT2BPETokenizer \\
       --merge-file gpt2-merges.txt \\
       --append-eod
""", {"my-corpus.json": "{corpus}", "gpt2-vocab.json": "{gpt2}/vocab.json", "gpt2-merges.txt": "{gpt2}/merges.txt",
      "my-gpt2": "{out}/my-gpt2"}, {"my-gpt2_text_document": "{gpt2}/eod_text_document"}),
    ("Hugging Face blog, 'How to train a Language Model with Megatron-LM' (CodeParrot)", """
python tools/preprocess_data.py \\
       --input codeparrot_data.json \\
       --output-prefix codeparrot \\
       --vocab vocab.json \\
       --dataset-impl mmap \\
       --tokenizer-type GPT2BPETokenizer \\
       --merge-file merges.txt \\
       --json-keys content \\
       --workers 32 \\
       --chunk-size 25 \\
       --append-eod
""", {"codeparrot_data.json": "{content_corpus}", "vocab.json": "{gpt2}/vocab.json",
      "merges.txt": "{gpt2}/merges.txt", "codeparrot": "{out}/codeparrot"},
     {"codeparrot_content_document": "{gpt2}/eod_text_document"}),
    ("Megatron-LM docs, data preparation and examples/llama (core_v0.16.1)", """
python tools/preprocess_data.py \\
    --input data.jsonl \\
    --output-prefix processed_data \\
    --tokenizer-type HuggingFaceTokenizer \\
    --tokenizer-model /path/to/tokenizer.model \\
    --workers 8 \\
    --append-eod
""", {"data.jsonl": "{tok_corpus}", "/path/to/tokenizer.model": "{tok}/neox", "processed_data": "{out}/processed_data"},
     {"processed_data_text_document": "{tok}/expected/hf_neox"}),
    ("GPT-NeoX README, preprocess_data.py example (its own tool; same flags)", """
python tools/datasets/preprocess_data.py \\
            --input ./data/mydataset.jsonl.zst \\
            --output-prefix ./data/mydataset \\
            --vocab ./data/gpt2-vocab.json \\
            --merge-file gpt2-merges.txt \\
            --dataset-impl mmap \\
            --tokenizer-type GPT2BPETokenizer \\
            --append-eod
""", {"./data/mydataset.jsonl.zst": "{corpus}", "./data/gpt2-vocab.json": "{gpt2}/vocab.json",
      "gpt2-merges.txt": "{gpt2}/merges.txt", "./data/mydataset": "{out}/mydataset"},
     {"mydataset_text_document": "{gpt2}/eod_text_document"}),
    ("GPT-NeoX with the Pythia/NeoX-20B tokenizer (its README: --tokenizer-type HFTokenizer, --vocab-file "
     "20B_tokenizer.json)", """
python tools/datasets/preprocess_data.py \\
            --input ./data/mydataset.jsonl \\
            --output-prefix ./data/mydataset \\
            --vocab-file ./20B_checkpoints/20B_tokenizer.json \\
            --dataset-impl mmap \\
            --tokenizer-type HFTokenizer \\
            --append-eod \\
            --workers 2
""", {"./data/mydataset.jsonl": "{tok_corpus}", "./20B_checkpoints/20B_tokenizer.json": "{tok}/neox/tokenizer.json",
      "./data/mydataset": "{out}/mydataset"}, {"mydataset_text_document": "{tok}/expected/hf_neox"}),
    ("the issue's composite of the Neuron and Megatron GPT seeds", """
python tools/preprocess_data.py --input my-corpus.json --output-prefix my-gpt2 --vocab-file gpt2-vocab.json \\
    --merge-file gpt2-merges.txt --dataset-impl mmap --tokenizer-type GPT2BPETokenizer --append-eod \\
    --workers 32 --chunk-size 25 --keep-newlines
""", {"my-corpus.json": "{corpus}", "gpt2-vocab.json": "{gpt2}/vocab.json", "gpt2-merges.txt": "{gpt2}/merges.txt",
      "my-gpt2": "{out}/my-gpt2"}, {"my-gpt2_text_document": "{gpt2}/eod_text_document"}),
]


def _swap(argv: list[str], paths: dict[str, str], places: dict[str, str]) -> list[str]:
    return [paths[a].format(**places) if a in paths else a for a in argv]


@pytest.mark.parametrize(("source", "command", "paths", "expected"), TUTORIALS, ids=[t[0][:40] for t in TUTORIALS])
def test_tutorial_command_runs_verbatim(tmp_path: Path, capsys, source: str, command: str, paths: dict[str, str],
                                        expected: dict[str, str]) -> None:
    if "HuggingFace" in command or "HFTokenizer" in command:
        pytest.importorskip("tokenizers")
    content = tmp_path / "content.jsonl"  # the fixture corpus with its text under the key "content"
    content.write_text("".join(json.dumps({"content": json.loads(line)["text"]}) + "\n"
                               for line in (FIXTURES / "corpus.jsonl").read_text().splitlines()))
    places = {"corpus": str(FIXTURES / "corpus.jsonl"), "content_corpus": str(content), "gpt2": str(FIXTURES),
              "tok": str(TOKENIZERS), "tok_corpus": str(TOKENIZERS / "corpus.jsonl"), "out": str(tmp_path)}
    argv = shlex.split(command.replace("\\\n", " "))  # a shell drops backslash-newline (line continuation)
    assert argv[0] == "python" and argv[1].endswith("preprocess_data.py")
    assert main(["data", "preprocess", *_swap(argv[2:], paths, places)]) == 0, source
    capsys.readouterr()
    for name, reference in expected.items():
        for ext in ("bin", "idx"):
            ours = (tmp_path / f"{name}.{ext}").read_bytes()
            assert ours == Path(f"{reference.format(**places)}.{ext}").read_bytes(), (source, ext)


def test_flags_that_change_nothing_say_so_and_other_formats_are_refused(tmp_path: Path, capsys) -> None:
    common = ["data", "preprocess", "--input", str(FIXTURES / "corpus.jsonl"), "--output-prefix", str(tmp_path / "p"),
              "--vocab", str(FIXTURES / "vocab.json"), "--merge-file", str(FIXTURES / "merges.txt")]
    assert main([*common, "--chunk-size", "25", "--keep-newlines", "--log-interval", "10"]) == 0
    err = capsys.readouterr().err
    assert "--chunk-size" in err and "--log-interval" in err and "--keep-newlines only matters" in err
    refused = [*common[:5], str(tmp_path / "lazy"), *common[6:], "--dataset-impl", "lazy"]
    assert main(refused) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("megatron-hpc: error: --dataset-impl lazy writes the old fairseq TNTIDX files, which "
                       "Megatron-core no longer reads; use --dataset-impl mmap (the default)")
    assert not list(tmp_path.glob("lazy*"))
