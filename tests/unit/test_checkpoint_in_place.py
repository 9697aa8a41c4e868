"""Loading a checkpoint into tensors that already exist (a CPU resume): same values as a fresh load, no new memory,
and a file that is damaged or does not fit is refused, naming it, before it can leave a model half overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.store import RankInfo, load_checkpoint, save_checkpoint
from megatron_hpc.checkpoint.store.file_io import CHUNK
from megatron_hpc.config.schema import CheckpointConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from megatron_hpc.errors import CheckpointError
from megatron_hpc.train.entry import plan_for_torchrun, run_training

RANKS = RankInfo()
TENSORS = "mp_rank_00/model_optim_rng.pt.tensors"


def _state() -> dict:
    torch.manual_seed(0)
    model = {"emb": torch.randn(CHUNK // 4 + 300, 2),  # more than one read piece, ragged end
             "w": torch.randn(16, 8).bfloat16(), "norm": torch.rand(8), "steps": torch.arange(5),
             "empty": torch.ones(0)}
    moments = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(t.float())}
               for i, t in enumerate(model.values())}
    return {"iteration": 3, "model": model, "optimizer": {"state": moments, "param_groups": [{"params": [0]}]}}


def _targets(model: dict[str, torch.Tensor], fill: float = float("nan")) -> dict[str, torch.Tensor]:
    """Existing tensors like the model's, holding `fill` so that any write to them shows."""
    return {k: torch.full_like(t, fill if t.is_floating_point() else 7) for k, t in model.items()}


def _untouched(targets: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isnan(t).all()) if t.is_floating_point() else bool((t == 7).all())
               for t in targets.values())


def _files(folder: Path) -> dict[str, Path]:
    """Model name -> its tensor file, from the order the saver numbers them (the model dict's order, first)."""
    return {name: folder / TENSORS / f"tensor_{i}.pt" for i, name in enumerate(_state()["model"])}


def test_in_place_load_equals_the_fresh_load_and_uses_the_given_memory(tmp_path: Path) -> None:
    saved = _state()
    save_checkpoint(tmp_path, 3, saved, ranks=RANKS)
    _found, fresh = load_checkpoint(tmp_path, ranks=RANKS)
    targets = _targets(saved["model"])
    pointers = {k: t.data_ptr() for k, t in targets.items()}
    _found, placed = load_checkpoint(tmp_path, ranks=RANKS, into={"model": targets})
    for name, tensor in fresh["model"].items():
        assert placed["model"][name] is targets[name] and targets[name].data_ptr() == pointers[name]
        assert targets[name].dtype == tensor.dtype and torch.equal(targets[name], tensor)
        assert torch.equal(tensor, saved["model"][name])
    for i, moments in fresh["optimizer"]["state"].items():  # everything else is read as before
        assert torch.equal(placed["optimizer"]["state"][i]["exp_avg"], moments["exp_avg"])
    assert placed["iteration"] == 3


def test_another_dtype_is_read_fresh_and_leaves_the_target_for_the_callers_copy(tmp_path: Path) -> None:
    saved = _state()
    save_checkpoint(tmp_path, 3, saved, ranks=RANKS)
    targets = _targets(saved["model"])
    targets["norm"] = torch.full((8,), float("nan"), dtype=torch.float64)  # e.g. a model cast after saving
    _found, placed = load_checkpoint(tmp_path, ranks=RANKS, into={"model": targets})
    assert placed["model"]["norm"] is not targets["norm"] and torch.isnan(targets["norm"]).all()
    assert placed["model"]["norm"].dtype == torch.float32
    assert torch.equal(placed["model"]["norm"], saved["model"]["norm"])
    assert placed["model"]["emb"] is targets["emb"] and torch.equal(targets["emb"], saved["model"]["emb"])


def test_a_shape_that_does_not_fit_is_refused_before_any_tensor_is_written(tmp_path: Path) -> None:
    saved = _state()
    save_checkpoint(tmp_path, 3, saved, ranks=RANKS)
    targets = _targets(saved["model"])
    targets["steps"] = torch.full((6,), 7)  # the model's last file but one: the others would be read first
    with pytest.raises(CheckpointError, match=r"tensor_3\.pt holds model\.steps of shape \(5,\), this run's is \(6,"):
        load_checkpoint(tmp_path, ranks=RANKS, into={"model": targets})
    assert _untouched(targets)


@pytest.mark.parametrize(("change", "message"), [
    ("drop", r"lacks 1 of this run's tensors \(extra\)"),
    ("rename", r"lacks 1 of this run's tensors \(norm_renamed\) and has 1 this run does not \(norm\)")])
def test_other_weights_are_refused_before_any_tensor_is_written(tmp_path: Path, change: str, message: str) -> None:
    saved = _state()
    save_checkpoint(tmp_path, 3, saved, ranks=RANKS)
    targets = _targets(saved["model"])
    if change == "drop":
        targets["extra"] = torch.full((2,), float("nan"))
    else:
        targets["norm_renamed"] = targets.pop("norm")
    with pytest.raises(CheckpointError, match=r"model_optim_rng\.pt does not fit this run: its 'model' " + message):
        load_checkpoint(tmp_path, ranks=RANKS, into={"model": targets})
    assert _untouched(targets)


def test_a_damaged_byte_is_refused_naming_the_file(tmp_path: Path) -> None:
    saved = _state()
    folder = save_checkpoint(tmp_path, 3, saved, ranks=RANKS)
    victim = _files(folder)["emb"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the elements: the zip and the pickle still parse
    victim.write_bytes(bytes(data))
    targets = _targets(saved["model"])
    with pytest.raises(CheckpointError, match=r"tensor_0\.pt has crc32 .* but the manifest says"):
        load_checkpoint(tmp_path, ranks=RANKS, into={"model": targets})


def test_a_truncated_file_is_refused_before_any_tensor_is_written(tmp_path: Path) -> None:
    saved = _state()
    folder = save_checkpoint(tmp_path, 3, saved, ranks=RANKS)
    victim = _files(folder)["steps"]
    victim.write_bytes(victim.read_bytes()[:-7])
    targets = _targets(saved["model"])
    with pytest.raises(CheckpointError, match=r"tensor_3\.pt has \d+ bytes but the manifest says"):
        load_checkpoint(tmp_path, ranks=RANKS, into={"model": targets})
    assert _untouched(targets)


def _tiny(num_steps: int, hidden: int = 64, **ckpt: object) -> RunConfig:
    return RunConfig(
        name="tiny",
        model=ModelConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, seq_length=32,
                          max_position_embeddings=32, vocab_size=500),
        train=TrainConfig(num_steps=num_steps, micro_batch_size=8, global_batch_size=8, log_interval=1),
        optim=OptimConfig(lr=3e-3, lr_decay_iters=4),  # the same LR at each step, however many steps the run has
        checkpoint=CheckpointConfig(**ckpt),
    )


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["lm_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_run_trains_on_exactly_the_saved_weights(tmp_path: Path) -> None:
    """The trainer's resume reads the weights into the model: the steps after it match an uninterrupted run."""
    run_training(plan_for_torchrun(_tiny(num_steps=4)), run_dir=tmp_path / "straight")
    run_training(plan_for_torchrun(_tiny(num_steps=2)), run_dir=tmp_path / "resumed")
    run_training(plan_for_torchrun(_tiny(num_steps=4)), run_dir=tmp_path / "resumed")
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")


def test_a_checkpoint_of_another_width_stops_the_run(tmp_path: Path) -> None:
    run_training(plan_for_torchrun(_tiny(num_steps=1, hidden=32)), run_dir=tmp_path / "narrow")
    wide = _tiny(num_steps=2, hidden=64, load=str(tmp_path / "narrow" / "checkpoints"))
    with pytest.raises(CheckpointError, match=r"of shape \(\d+, 32\), this run's is \(\d+, 64\)"):
        run_training(plan_for_torchrun(wide), run_dir=tmp_path / "wide")
