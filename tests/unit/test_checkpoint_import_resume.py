"""Continuing from a checkpoint of the Neuron reference: converted, it resumes where that model was (the same losses
as resuming the original run), or starts a fine-tuning run from its weights (checkpoint.finetune)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import megatron_writers as mw

from megatron_hpc.checkpoint.conversion import read_whole
from megatron_hpc.checkpoint.conversion.optim_layout import by_name
from megatron_hpc.checkpoint.conversion.whole import write_whole
from megatron_hpc.checkpoint.store import read_progress
from megatron_hpc.cli.main import main
from megatron_hpc.config.schema import (
    CheckpointConfig,
    CompilePhaseConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from megatron_hpc.train.entry import plan_for_torchrun, run_training

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
GBS = 8


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def _run(run_dir: Path, num_steps: int, **ckpt: Any) -> list[dict[str, Any]]:
    cfg = RunConfig(
        name="tiny",
        model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                          max_position_embeddings=16, vocab_size=64, make_vocab_size_divisible_by=8),
        train=TrainConfig(num_steps=num_steps, micro_batch_size=GBS, global_batch_size=GBS, log_interval=1,
                          tensorboard=False),
        optim=OptimConfig(lr=1e-2, lr_decay_iters=40),
        checkpoint=CheckpointConfig(**ckpt),
        compile=CompilePhaseConfig(num_steps=1),
    )
    assert run_training(plan_for_torchrun(cfg), run_dir=run_dir) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _as_reference(ours: Path, out: Path, *, weights: torch.dtype | None = None) -> None:
    """Our checkpoint rewritten as the Neuron reference saves it with --save-xser: flat args, the legacy nested model,
    torch's AdamW state in Megatron's groups, the scheduler counting samples, numpy's RNG state as an array.
    `weights`: the model alone, in that dtype (a --no-save-optim save of a bf16 run keeps no fp32 masters)."""
    state = read_whole(ours).first
    model, progress = state["model"], read_progress(state, where=ours)
    if weights is not None:
        model = {n: w.to(weights) for n, w in model.items()}
    moments = by_name(model, state["optimizer"])
    nested = [mw.legacy_model(d, layers=[0, 1], first=True, last=True, version=3.0, heads=4)
              for d in (model, {n: m["exp_avg"] for n, m in moments.items()},
                        {n: m["exp_avg_sq"] for n, m in moments.items()})]
    params = list(mw.flat(nested[0]).items())
    group = state["optimizer"]["param_groups"][0]  # the run's AdamW settings
    optimizer = mw.optimizer_state(params, list(mw.flat(nested[1]).values()), list(mw.flat(nested[2]).values()),
                                   step=float(progress.lr_steps), lr=group["lr"], weight_decay=group["weight_decay"],
                                   betas=tuple(group["betas"]))
    name, keys, pos, has_gauss, cached = state["np_rng_state"]
    reference = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "tensor_model_parallel_size": 1,
                 "pipeline_model_parallel_size": 1, "consumed_train_samples": progress.consumed_samples,
                 "consumed_valid_samples": 0, "max_position_embeddings": 16, "make_vocab_size_divisible_by": 8,
                 "padded_vocab_size": 64, "tokenizer_type": "GPT2BPETokenizer", "checkpoint_version": 3.0,
                 "iteration": progress.iteration, "model": nested[0], "optimizer": optimizer,
                 "lr_scheduler": {"max_lr": 1e-2, "warmup_steps": 0, "num_steps": progress.lr_steps * GBS,
                                  "decay_style": "cosine", "decay_steps": 40 * GBS, "min_lr": 0.0},
                 "random_rng_state": state["random_rng_state"],
                 "np_rng_state": [name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached],
                 "torch_rng_state": state["torch_rng_state"], "cuda_rng_state": state["torch_rng_state"],
                 "rng_tracker_states": {}}
    if weights is not None:
        del reference["optimizer"]
    mw.save_reference_xser(reference, out / f"iter_{progress.iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt")
    mw.write_tracker(out, progress.iteration)


def test_a_converted_reference_checkpoint_continues_where_its_model_was(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    trained = _run(tmp_path / "a", 6, save=str(tmp_path / "a-ckpt"))
    fresh_loss = trained[0]["lm_loss"]
    resumed = _run(tmp_path / "a2", 8, load=str(tmp_path / "a-ckpt"), save=str(tmp_path / "a2-ckpt"))
    assert [r["iteration"] for r in resumed] == [7, 8]

    _as_reference(tmp_path / "a-ckpt", tmp_path / "reference")
    assert main(["ckpt", "convert", str(tmp_path / "reference"), "--to", "xser", "--out", str(tmp_path / "conv")]) == 0
    capsys.readouterr()
    continued = _run(tmp_path / "c", 8, load=str(tmp_path / "conv"), save=str(tmp_path / "c-ckpt"))
    assert [r["iteration"] for r in continued] == [7, 8]
    assert continued[0]["consumed_samples"] == 7 * GBS
    assert continued[0]["lr"] == resumed[0]["lr"]
    # The same model, Adam moments, LR position and data position: the original run's next losses.
    for got, want in zip(continued, resumed):
        assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5, abs=1e-6)
    assert continued[0]["lm_loss"] < fresh_loss - 0.5  # not from scratch: a fresh model is near log(64) = 4.16

    # Fine-tuning from its weights: iterations from 1, the loss where the model was, not a fresh init's.
    tuned = _run(tmp_path / "f", 2, load=str(tmp_path / "conv"), save=str(tmp_path / "f-ckpt"), finetune=True)
    assert [r["iteration"] for r in tuned] == [1, 2]
    assert tuned[0]["lr"] == trained[0]["lr"]  # the LR schedule starts over
    assert tuned[0]["lm_loss"] < fresh_loss - 0.5
    assert "weights only, starting at iteration 0: checkpoint.finetune" in capsys.readouterr().out
    # A restart of the fine-tuning run resumes from its own checkpoint, not from the converted one again.
    again = _run(tmp_path / "f", 3, load=str(tmp_path / "conv"), save=str(tmp_path / "f-ckpt"), finetune=True)
    assert [r["iteration"] for r in again][-1:] == [3]
    assert "loaded checkpoint " + str(tmp_path / "f-ckpt" / "iter_0000002") in capsys.readouterr().out


def test_a_bf16_weights_only_checkpoint_stays_bf16_and_trains_as_its_values(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bf16 save without fp32 masters converts to bf16 (half the bytes of fp32, no information lost), and a run
    fine-tuned from it takes the same steps as one from an fp32 checkpoint of the same bf16-rounded values."""
    _run(tmp_path / "a", 3, save=str(tmp_path / "a-ckpt"))
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).split(".")[-1]
        source = tmp_path / "a-ckpt"
        if dtype == torch.float32:  # the bf16 values, held in fp32: what a cast at load must give
            source = tmp_path / "rounded-ckpt"
            _rounded_copy(tmp_path / "a-ckpt", source)
        _as_reference(source, tmp_path / f"ref-{name}", weights=dtype)
        capsys.readouterr()
        assert main(["ckpt", "convert", str(tmp_path / f"ref-{name}"), "--to", "xser", "--out",
                     str(tmp_path / f"conv-{name}"), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["weights_dtype"] == name
        state = read_whole(tmp_path / f"conv-{name}").first
        assert {w.dtype for w in state["model"].values()} == {dtype}
        runs[name] = _run(tmp_path / f"f-{name}", 3, load=str(tmp_path / f"conv-{name}"),
                          save=str(tmp_path / f"f-{name}-ckpt"), finetune=True)
    capsys.readouterr()
    bf16, fp32 = read_whole(tmp_path / "conv-bfloat16").first["model"], read_whole(tmp_path / "conv-float32").first[
        "model"]
    assert all(torch.equal(bf16[n].float(), fp32[n]) for n in fp32)
    # The same fp32 parameters in one process, one thread of code: the same losses, bit for bit.
    assert [r["lm_loss"] for r in runs["bfloat16"]] == [r["lm_loss"] for r in runs["float32"]]
    # The rounding shows: the unrounded fp32 weights give another first loss (about 6e-6 relative here, some 90
    # float32 ulps), so the equality above is not one that any weights would meet.
    exact = _run(tmp_path / "f-exact", 1, load=str(tmp_path / "a-ckpt"), save=str(tmp_path / "f-exact-ckpt"),
                 finetune=True)
    assert exact[0]["lm_loss"] != pytest.approx(runs["bfloat16"][0]["lm_loss"], rel=1e-6, abs=0)


def _rounded_copy(ours: Path, out: Path) -> None:
    """Our checkpoint at `ours` with every weight rounded to bf16 and held in fp32, saved by our own writer."""
    whole = read_whole(ours)
    for row in whole.grid:
        for state in row:
            state["model"] = {n: w.to(torch.bfloat16).float() for n, w in state["model"].items()}
    write_whole(out, whole.iteration, whole.grid, fmt="xser")


def test_load_optim_and_load_rng_false_keep_progress_but_start_adam_afresh(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path / "a", 3, save=str(tmp_path / "a-ckpt"))
    resumed = _run(tmp_path / "b", 4, load=str(tmp_path / "a-ckpt"), save=str(tmp_path / "b-ckpt"))
    capsys.readouterr()
    afresh = _run(tmp_path / "c", 4, load=str(tmp_path / "a-ckpt"), save=str(tmp_path / "c-ckpt"), load_optim=False,
                  load_rng=False)
    assert [r["iteration"] for r in afresh] == [4]
    assert afresh[0]["lr"] == resumed[0]["lr"] and afresh[0]["consumed_samples"] == resumed[0]["consumed_samples"]
    # Same weights and batch, so the same loss; Adam's first step from zero moments moves the weights otherwise.
    assert afresh[0]["lm_loss"] == pytest.approx(resumed[0]["lm_loss"], rel=1e-6)
    stepped = read_whole(tmp_path / "c-ckpt").first["optimizer"]
    assert {float(s["step"]) for s in stepped["state"].values()} == {1.0}
    assert "optimizer afresh: checkpoint.load_optim=false, RNG from train.seed: checkpoint.load_rng=false" in \
        capsys.readouterr().out
