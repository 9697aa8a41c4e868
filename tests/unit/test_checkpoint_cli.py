"""`megatron-hpc ckpt inspect` on a checkpoint folder and on a single xser file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.store import RankInfo, save_checkpoint
from megatron_hpc.checkpoint.store.xser import write_xser
from megatron_hpc.cli.main import main


def test_inspect_folder_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"iteration": 12, "tensor_model_parallel_size": 1,
             "model": {"wte.weight": torch.zeros(8, 4), "ln.bias": torch.zeros(4, dtype=torch.bfloat16)}}
    save_checkpoint(tmp_path, 12, state, ranks=RankInfo())
    assert main(["ckpt", "inspect", str(tmp_path), "--json", "--verify"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["iteration"], out["tensor_parallel"], out["data_parallel"]) == (12, 1, 1)
    assert [(t["name"], t["shape"], t["dtype"]) for t in out["tensors"]] == [
        ("model.wte.weight", [8, 4], "float32"), ("model.ln.bias", [4], "bfloat16")]


def test_inspect_single_file_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_xser({"iteration": 3, "model": {"w": torch.ones(2, 3)}}, tmp_path / "model_optim_rng.pt")
    assert main(["ckpt", "inspect", str(tmp_path / "model_optim_rng.pt")]) == 0
    out = capsys.readouterr().out
    assert "iteration   3 (xser)" in out and "model.w" in out and "(2, 3)" in out


def test_inspect_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ckpt", "inspect", str(tmp_path)]) == 1
    assert "is not a checkpoint" in capsys.readouterr().err


def test_inspect_a_path_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ckpt", "inspect", str(tmp_path / "iter_0000007")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megatron-hpc: error: {tmp_path / 'iter_0000007'} does not exist; pass a checkpoint folder (with "
                   "latest_checkpointed_iteration.txt), one of its iter_XXXXXXX folders or a model_optim_rng.pt file"]


def test_inspect_shows_what_the_weights_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Under XLA_USE_BF16 the files say float32 but the values are bf16: the trainer's record says so."""
    write_xser({"iteration": 3, "model": {"w": torch.ones(2, 3)},
                "precision": {"train_precision": "bf16", "weights_hold": "bfloat16"}}, tmp_path / "pure.pt")
    write_xser({"iteration": 3, "model": {"w": torch.ones(2, 3)},
                "precision": {"train_precision": "fp32", "weights_hold": "float32"}}, tmp_path / "fp32.pt")
    write_xser({"iteration": 3, "model": {"w": torch.ones(2, 3)}}, tmp_path / "old.pt")
    assert main(["ckpt", "inspect", str(tmp_path / "pure.pt")]) == 0
    assert "precision   bf16 (weights hold bfloat16 values, stored as float32)" in capsys.readouterr().out
    assert main(["ckpt", "inspect", str(tmp_path / "fp32.pt")]) == 0
    assert "precision   fp32 (weights hold float32 values)\n" in capsys.readouterr().out
    assert main(["ckpt", "inspect", str(tmp_path / "old.pt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] is None  # written before the record existed


def test_a_run_folder_is_told_where_its_checkpoints_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`evaluate runs/NAME` (or generate, convert) of a run folder, not its checkpoints/ folder: the refusal names
    the folder that works."""
    save_checkpoint(tmp_path / "run" / "checkpoints", 4, {"iteration": 4, "model": {"w": torch.ones(2)}},
                    ranks=RankInfo())
    assert main(["ckpt", "convert", str(tmp_path / "run"), "--to", "torch", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"it is a run folder: pass {tmp_path / 'run' / 'checkpoints'}"), err
    assert not (tmp_path / "out").exists()
    assert main(["ckpt", "convert", str(tmp_path), "--to", "torch", "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip().endswith("pass the folder a run saved into")
