"""What `plan` and `submit` say about the data a run trains on and the checkpoints it writes, and what they refuse."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megatron_hpc.cli.main import main
from megatron_hpc.data.indexed import IndexedDatasetWriter


def _corpus(tmp_path: Path, *, docs: int = 100, length: int = 1000) -> str:
    prefix = str(tmp_path / "corpus_text_document")
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for i in range(docs):
            writer.add_document(np.full(length, i % 50000, dtype=np.uint16))
    return prefix


def test_real_cluster_recipe_without_data_is_refused_with_the_fix(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["submit", "--recipe", "gpt3_6.7b", "--nodes", "16", "--dry-run", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gpt3_6.7b on trn1 has no training data" in err[0]
    assert "--set data.path=PREFIX" in err[0] and "--set data.source=synthetic" in err[0]
    assert not out.exists()  # refused before anything was written
    # `plan` still plans it (sizing needs no data), says what is missing, and warns that submit refuses it.
    assert main(["plan", "--recipe", "gpt3_6.7b", "--nodes", "16"]) == 0
    captured = capsys.readouterr()
    assert "data        none: no data.path" in captured.out
    assert "`submit` refuses this plan" in captured.err


def test_with_data_plan_and_submit_say_what_it_trains_on_and_saves(tmp_path, capsys):
    prefix = _corpus(tmp_path)  # 100 documents of 1000 tokens; the train split (969,30,1) holds 97 of them
    sets = ["--set", f"data.path={prefix}", "--set", "train.num_steps=10"]
    assert main(["plan", "--recipe", "gpt3_6.7b", "--nodes", "16", "--json", *sets]) == 0
    plan = json.loads(capsys.readouterr().out)
    data = plan["data"]
    assert (data["source"], data["path"], data["tokens"], data["train_tokens"]) == ("indexed", prefix, 100_000, 97_000)
    assert data["tokens_needed"] == 10 * 1024 * 2048
    assert data["epochs"] == pytest.approx(10 * 1024 * 2048 / 97_000)
    assert plan["data_source"] == "indexed" and plan["checkpoint_gib"] > 70
    out = tmp_path / "run"
    assert main(["submit", "--recipe", "gpt3_6.7b", "--nodes", "16", "--dry-run", "--out", str(out), *sets]) == 0
    text = capsys.readouterr().out
    assert f"data        indexed {prefix}: 100K tokens, 97K in the train split; the run reads 21M tokens, " \
           f"{10 * 1024 * 2048 / 97_000:.2f} epoch(s)" in text
    assert "checkpoint  74.5 GiB each (fp32 weights + Adam moments), every 2000 steps and at the end; keeps the " \
           "last 2" in text
    assert json.loads((out / "plan.json").read_text())["data_source"] == "indexed"


def test_synthetic_data_on_a_real_cluster_is_said_loudly(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["submit", "--recipe", "gpt3_6.7b", "--nodes", "16", "--dry-run", "--out", str(out), "--json",
                 "--set", "data.source=synthetic"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["data"]["source"] == "synthetic"
    assert any("SYNTHETIC tokens" in w and "not real data" in w for w in report["warnings"])


@pytest.mark.parametrize("bad", ["optim.lr=-1", "train.num_steps=0", "model.num_attention_heads=0",
                                 "parallel.tensor=-1", "model.vocab_size=0"])
def test_bad_values_are_one_line_before_anything_is_written(tmp_path, capsys, bad):
    out = tmp_path / "d"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out), "--set", bad]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"megatron-hpc: error: {bad.split('=')[0]}=")
    assert not out.exists()


def test_a_save_folder_too_small_for_the_checkpoints_is_a_warning(tmp_path, capsys):
    """A real small filesystem (tmpfs, mounted as root the way CI runs), not a patched disk_usage."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)], check=True)
    try:
        sets = ["--set", f"checkpoint.save={small}/ckpt", "--set", "checkpoint.keep_last=2"]
        assert main(["submit", "--recipe", "tiny", "--dry-run", "--json", "--out", str(tmp_path / "a"), *sets]) == 0
        warnings = json.loads(capsys.readouterr().out)["warnings"]
        # tiny's checkpoint is about 61 MiB: three of them (keep 2 while the next is written) do not fit in 64 MiB.
        room = [w for w in warnings if "checkpoints of" in w]
        assert len(room) == 1 and room[0].startswith(f"{small}/ckpt has 0.1 GiB free, but keeping 2 checkpoints")
        assert "lower checkpoint.keep_last" in room[0]
        assert main(["submit", "--recipe", "tiny", "--dry-run", "--json", "--out", str(tmp_path / "b"),
                     "--set", f"checkpoint.save={tmp_path}/big"]) == 0
        assert not [w for w in json.loads(capsys.readouterr().out)["warnings"] if "checkpoints of" in w]
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_anything_is_written(tmp_path, capsys):
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
    sets = ["--set", f"data.path={_corpus(tmp_path, length=100)}", "--set", f"data.vocab_file={fixtures}/vocab.json",
            "--set", f"data.merge_file={fixtures}/merges.txt"]
    out = tmp_path / "d"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out), *sets,
                 "--set", "model.vocab_size=256"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-hpc: error: model.vocab_size 256 is smaller than the 400 ids")
    assert err[0].endswith("use --set model.vocab_size=400 (the planner pads it)")
    assert not out.exists()
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out), *sets,
                 "--set", "model.vocab_size=50000", "--set", "data.merge_file=/nowhere/merges.txt"]) == 0
    assert "the tokenizer of data.* was not checked against model.vocab_size" in capsys.readouterr().err


def test_the_refusal_names_the_tokenizer_the_run_reads_not_the_recipes_gpt2_files(tmp_path, capsys):
    """tiny sets GPT-2 vocab.json and merges.txt; a HuggingFaceTokenizer set over it (the line `ckpt convert` of an
    HF folder prints) reads only its tokenizer.json, and the refusal names that."""
    import tokenizers

    folder = tmp_path / "tok"
    folder.mkdir()
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([f"word{i} and more{i}" for i in range(400)], vocab_size=300, min_frequency=1)
    bpe.save(str(folder / "tokenizer.json"))
    sets = ["--set", f"data.path={_corpus(tmp_path, length=100)}", "--set", "data.tokenizer_type=HuggingFaceTokenizer",
            "--set", f"data.tokenizer_model={folder}", "--set", "model.vocab_size=256"]
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(tmp_path / "d"), *sets]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"ids of the tokenizer HuggingFaceTokenizer ({folder}):" in err[0], err
    assert "merges.txt" not in err[0] and not (tmp_path / "d").exists()


def test_a_fine_tune_whose_checkpoint_load_holds_nothing_is_refused_before_queueing(tmp_path, monkeypatch, capsys):
    """The line `ckpt convert` printed, pasted in another directory with a relative checkpoint.load: the trainer found
    no checkpoint there and fine-tuned random weights without a word. Refused here, nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    for load, why in (("imported", "it does not exist"), ("empty", "no checkpoint in it")):
        out = tmp_path / f"run-{load}"
        assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out), "--set", "data.source=synthetic",
                     "--set", f"checkpoint.load={load}", "--set", "checkpoint.finetune=true"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"checkpoint.load={load} holds no checkpoint to fine-tune from ({why}; " in err[0]
        assert str(tmp_path / load) in err[0] and not out.exists()
