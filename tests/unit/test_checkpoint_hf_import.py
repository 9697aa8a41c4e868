"""`ckpt convert HF_DIR --to xser|torch`: a tiny random GPT2LMHeadModel of the real `transformers`, saved by
save_pretrained (safetensors, shards with their index) or as pytorch_model.bin, becomes our checkpoint; our GPT then
computes transformers' logits, the export gives back the same tensors, and a run fine-tunes from it."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers  # the real library (the `test` extra installs it)
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from hf_models import SEQ, TOKENS, VOCAB, hf_logits, hf_model, save

from megatron_hpc.checkpoint.conversion import pp_layout, read_whole, tokenizer_files
from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import from_dict, load_recipe
from megatron_hpc.config.schema import (
    ModelConfig,
)
from megatron_hpc.data.synthetic import SyntheticTokens
from megatron_hpc.errors import CheckpointError
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.train.entry import plan_for_torchrun, run_training


def our_logits(ckpt: Path, ctx: ParallelContext, **change: object) -> torch.Tensor:
    """Our GPT from the checkpoint's files and its resolved model config (optionally changed), at TP 1."""
    whole = read_whole(ckpt)
    cfg = dataclasses.replace(from_dict(ModelConfig, whole.first["resolved_config"]["model"], where="model"),
                              **change)
    full = pp_layout.merge_grid([[s["model"] for s in row] for row in whole.grid], num_layers=cfg.num_layers)
    model = GPT(cfg, ctx=ctx, padded_vocab=full["wte.weight"].shape[0], seed=1)
    model.load_state_dict(full)
    with torch.no_grad():
        return model.eval()(TOKENS)[..., :VOCAB]


def convert(*args: str) -> int:
    return main(["ckpt", "convert", *args])


@pytest.mark.parametrize("how", ["safetensors", "bin", "shards"])
def test_imported_gpt2_gives_transformers_logits(how: str, tmp_path: Path, tokenizer: Path, ctx: ParallelContext,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    theirs = hf_model()
    folder = save(theirs, tmp_path / "hf", how, tokenizer)
    if how == "shards":
        assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert convert(str(folder), "--to", "torch", "--out", str(tmp_path / "ours"), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["architecture"], report["tensor_parallel"], report["iteration"]) == ("GPT2LMHeadModel", 1, 0)
    torch.testing.assert_close(our_logits(tmp_path / "ours", ctx), hf_logits(theirs), rtol=0, atol=1e-4)
    # The tokenizer is copied beside the checkpoint, where generate and --to hf look for it.
    vocab, merges = tokenizer_files(read_whole(tmp_path / "ours"))
    assert vocab.parent == (tmp_path / "ours" / "tokenizer").absolute()
    assert vocab.read_bytes() == (tokenizer / "vocab.json").read_bytes()
    assert merges.read_bytes() == (tokenizer / "merges.txt").read_bytes()


def test_generate_continues_like_transformers_with_the_copied_tokenizer(tmp_path: Path, tokenizer: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    theirs = hf_model()
    folder = save(theirs, tmp_path / "hf", "safetensors", tokenizer)
    ids = transformers.AutoTokenizer.from_pretrained(folder)("the quick", return_tensors="pt").input_ids
    want = theirs.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=VOCAB - 1)[0, ids.shape[1]:].tolist()
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "ours")) == 0
    capsys.readouterr()
    # No --vocab-file / --merge-file: generate finds the tokenizer the import copied.
    try:
        assert main(["generate", str(tmp_path / "ours"), "--prompt", "the quick", "--max-new-tokens", "6",
                     "--ignore-eos", "--json"]) == 0
    finally:  # generate makes a one-rank process group in this process, as its CLI does
        if dist.is_initialized():
            dist.destroy_process_group()
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert result["prompt_ids"] == ids[0].tolist() and result["tokens"] == want


def test_the_activation_option_is_what_makes_gpt2_match(tmp_path: Path, ctx: ParallelContext) -> None:
    for act, ours in (("gelu_new", "gelu_tanh"), ("gelu", "gelu")):
        theirs = hf_model(act)
        folder = save(theirs, tmp_path / act, "safetensors")
        assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / f"{act}-ours")) == 0
        assert read_whole(tmp_path / f"{act}-ours").first["resolved_config"]["model"]["activation"] == ours
        want = hf_logits(theirs)
        torch.testing.assert_close(our_logits(tmp_path / f"{act}-ours", ctx), want, rtol=0, atol=1e-4)
        other = "gelu" if ours == "gelu_tanh" else "gelu_tanh"
        wrong = our_logits(tmp_path / f"{act}-ours", ctx, activation=other)
        assert (wrong - want).abs().max() > 1e-3  # the other GeLU is measurably off: the option matters
        # Exported back, config.json names the activation transformers needs.
        assert convert(str(tmp_path / f"{act}-ours"), "--to", "hf", "--out", str(tmp_path / f"{act}-back")) == 0
        assert json.loads((tmp_path / f"{act}-back" / "config.json").read_text())["activation_function"] == act


@pytest.mark.parametrize("tied", [True, False])
def test_export_of_an_import_at_tp2_pp2_gives_back_the_same_tensors(tied: bool, tmp_path: Path,
                                                                      tokenizer: Path) -> None:
    theirs = hf_model(tied=tied)
    folder = save(theirs, tmp_path / "hf", "safetensors", tokenizer)
    assert convert(str(folder), "--to", "xser", "--tp", "2", "--pp", "2", "--out", str(tmp_path / "ours")) == 0
    whole = read_whole(tmp_path / "ours")
    assert (whole.tensor_parallel, whole.pipeline_parallel) == (2, 2)
    assert convert(str(tmp_path / "ours"), "--to", "hf", "--out", str(tmp_path / "back")) == 0
    want = {k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight" or not tied}
    got = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert (tmp_path / "back" / "vocab.json").read_bytes() == (tokenizer / "vocab.json").read_bytes()
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    torch.testing.assert_close(hf_logits(again), hf_logits(theirs), rtol=0, atol=1e-5)


def test_a_tokenizer_json_alone_travels_through_import_and_export(tmp_path: Path, tokenizer: Path) -> None:
    folder = save(hf_model(), tmp_path / "hf", "safetensors", tokenizer)
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    for name in ("vocab.json", "merges.txt"):  # as NeoX-style folders ship it: tokenizer.json only
        (folder / name).unlink(missing_ok=True)
    want = transformers.AutoTokenizer.from_pretrained(folder)("the quick brown fox").input_ids
    assert convert(str(folder), "--to", "torch", "--out", str(tmp_path / "ours")) == 0
    data = read_whole(tmp_path / "ours").first["resolved_config"]["data"]
    assert data == {"tokenizer_type": "HuggingFaceTokenizer",
                    "tokenizer_model": str((tmp_path / "ours" / "tokenizer").absolute())}
    assert convert(str(tmp_path / "ours"), "--to", "hf", "--out", str(tmp_path / "back")) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "back")("the quick brown fox").input_ids == want


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("megatron-hpc: error: "), err
    return err


def test_bad_folders_fail_in_one_line_and_write_nothing(tmp_path: Path, tokenizer: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    moe = save(hf_model(), tmp_path / "moe", "safetensors")
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "architectures": ["MixtralForCausalLM"]}))
    assert convert(str(moe), "--to", "xser", "--out", str(out)) == 1
    err = _one_line_error(capsys)
    assert "MixtralForCausalLM (mixture-of-experts MLPs" in err and "supported: GPT2LMHeadModel" in err
    assert not out.exists()

    bare = save(hf_model(), tmp_path / "bare", "safetensors")
    (bare / "model.safetensors").unlink()
    assert convert(str(bare), "--to", "xser", "--out", str(out)) == 1
    assert "has no model.safetensors or pytorch_model.bin" in _one_line_error(capsys) and not out.exists()

    shards = save(hf_model(), tmp_path / "shards", "shards")
    index = shards / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    moved = sorted(data["weight_map"])[0]  # the index says it is in another shard than the one holding it
    others = sorted(set(data["weight_map"].values()) - {data["weight_map"][moved]})
    data["weight_map"][moved] = others[0]
    index.write_text(json.dumps(data))
    assert convert(str(shards), "--to", "xser", "--out", str(out)) == 1
    err = _one_line_error(capsys)
    assert "disagree" in err and moved in err and not out.exists()

    gone = save(hf_model(), tmp_path / "gone", "shards")
    next(iter(sorted(gone.glob("model-*.safetensors")))).unlink()
    assert convert(str(gone), "--to", "xser", "--out", str(out)) == 1
    assert "copy every shard" in _one_line_error(capsys) and not out.exists()

    tokens = len(json.loads((tokenizer / "vocab.json").read_text()))
    small = hf_model()
    small.resize_token_embeddings(tokens - 5)  # fewer rows than the tokenizer has tokens
    save(small, tmp_path / "small", "safetensors", tokenizer)
    assert convert(str(tmp_path / "small"), "--to", "xser", "--out", str(out)) == 1
    err = _one_line_error(capsys)
    assert f"{tokens} tokens" in err and f"vocab_size is {tokens - 5}" in err and not out.exists()

    wider = save(hf_model(), tmp_path / "wider", "safetensors")
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "n_inner": 64}))  # the weights' MLP is 4 x 32 = 128
    assert convert(str(wider), "--to", "xser", "--out", str(out)) == 1
    err = _one_line_error(capsys)
    assert "transformer.h.0.mlp.c_fc.weight is (32, 128), but config.json makes it (32, 64)" in err
    assert not out.exists()

    holed = save(hf_model(), tmp_path / "holed", "safetensors")
    weights = load_file(str(holed / "model.safetensors"))
    del weights["transformer.h.1.ln_2.bias"]
    save_file(weights, str(holed / "model.safetensors"))
    assert convert(str(holed), "--to", "xser", "--out", str(out)) == 1
    assert "have no transformer.h.1.ln_2.bias" in _one_line_error(capsys) and not out.exists()

    ok = save(hf_model(), tmp_path / "ok", "safetensors")
    assert main(["ckpt", "inspect", str(ok)]) == 1
    assert f"ckpt convert {ok} --to xser --out DIR" in _one_line_error(capsys)
    assert convert(str(ok), "--to", "xser", "--tp", "3", "--out", str(out)) == 1
    assert "--tp 3" in _one_line_error(capsys) and not out.exists()


def test_a_pickle_that_runs_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = save(hf_model(), tmp_path / "evil", "bin")

    class Boom:
        def __reduce__(self):  # what a malicious pytorch_model.bin does: call something on load
            return (print, ("ran",))

    torch.save({"transformer.wte.weight": Boom()}, folder / "pytorch_model.bin")
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "out")) == 1
    err = _one_line_error(capsys)
    assert "asks for print" in err and "nothing in it ran" in err and not (tmp_path / "out").exists()


def _train_hf(model: transformers.GPT2LMHeadModel, steps: int) -> None:
    """Teach the HF model the synthetic progressions (other samples than the run below reads)."""
    data = SyntheticTokens(vocab_size=VOCAB, seq_length=SEQ - 1, seed=99)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = data.batch(range(8 * step, 8 * step + 8))
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _run(run_dir: Path, sets: list[str]) -> list[dict[str, object]]:
    """The tiny recipe with `sets`, on synthetic tokens, in this process."""
    cfg = load_recipe("tiny", [*sets, "data.source=synthetic", "train.num_steps=2", "train.micro_batch_size=8",
                               "train.global_batch_size=8", "train.log_interval=1", "train.tensorboard=false",
                               "optim.lr=1e-3", f"checkpoint.save={run_dir / 'ckpt'}"])
    assert run_training(plan_for_torchrun(cfg), run_dir=run_dir) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_fine_tunes_from_imported_gpt2_weights_with_the_printed_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    theirs = hf_model()
    _train_hf(theirs, 60)
    folder = save(theirs, tmp_path / "hf", "safetensors")
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "ours")) == 0
    # What the command tells the user to run with, taken as printed.
    sets = shlex.split(capsys.readouterr().out.strip().split("fine-tune from it with ", 1)[1])[1::2]  # past --set
    assert f"checkpoint.load={tmp_path / 'ours'}" in sets and "checkpoint.finetune=true" in sets
    model_sets = [s for s in sets if s.startswith(("model.", "parallel."))]
    fresh = _run(tmp_path / "fresh", model_sets)
    tuned = _run(tmp_path / "tuned", sets)
    assert "weights only, starting at iteration 0: checkpoint.finetune" in capsys.readouterr().out
    assert [r["iteration"] for r in tuned] == [1, 2]
    # A checkpoint.load that holds nothing (a relative path pasted elsewhere) is an error, not a random-weight run.
    with pytest.raises(CheckpointError, match="holds no complete checkpoint to fine-tune from"):
        _run(tmp_path / "lost", [s if not s.startswith("checkpoint.load=") else f"checkpoint.load={tmp_path / 'gone'}"
                                 for s in sets])
    # The same first batch: a random init is near log(320) = 5.8, the imported model knows the progressions.
    assert tuned[0]["lm_loss"] < fresh[0]["lm_loss"] - 3.0, (tuned[0], fresh[0])
