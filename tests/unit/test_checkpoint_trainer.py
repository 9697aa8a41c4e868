"""The trainer's checkpoint calls, in this process (a world of one): when it saves, full disks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron_hpc.checkpoint.store import paths
from megatron_hpc.config.schema import (
    CheckpointConfig,
    CompilePhaseConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from megatron_hpc.errors import CheckpointError
from megatron_hpc.train.entry import plan_for_torchrun, run_training

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*TORCHRUN_VARS, "NEURON_EXTRACT_GRAPHS_ONLY"):
        monkeypatch.delenv(var, raising=False)


def _tiny(num_steps: int = 4, **ckpt: object) -> RunConfig:
    return RunConfig(
        name="tiny",
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                          max_position_embeddings=32, vocab_size=500),
        train=TrainConfig(num_steps=num_steps, micro_batch_size=8, global_batch_size=8),
        optim=OptimConfig(lr=3e-3),
        checkpoint=CheckpointConfig(**ckpt),
        compile=CompilePhaseConfig(num_steps=2),
    )


def _iterations(run_dir: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_saves_at_interval_and_end_into_run_dir(tmp_path: Path) -> None:
    run_training(plan_for_torchrun(_tiny(num_steps=5, save_interval=2, keep_last=5)), run_dir=tmp_path)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000005", paths.TRACKER]
    # Same recipe again: it resumes at 5, trains nothing and saves nothing new.
    run_training(plan_for_torchrun(_tiny(num_steps=5, save_interval=2, keep_last=5)), run_dir=tmp_path)
    assert _iterations(tmp_path) == [1, 2, 3, 4, 5]


def test_no_saves_in_compile_phase_or_graph_extraction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_training(plan_for_torchrun(_tiny(save_interval=1)), phase="compile", run_dir=tmp_path / "compile")
    monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", "1")
    run_training(plan_for_torchrun(_tiny(save_interval=1)), run_dir=tmp_path / "extract")
    assert not (tmp_path / "compile" / "checkpoints").exists()
    assert not (tmp_path / "extract" / "checkpoints").exists()


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs: about half of one checkpoint of the tiny model (about 1.9 MB), so every save fails."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True, capture_output=True)
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_continue_keeps_training(tmp_path: Path, small_disk: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _tiny(num_steps=4, save=str(small_disk), save_interval=2, on_save_failure="continue")
    assert run_training(plan_for_torchrun(cfg), run_dir=tmp_path) == 0
    assert _iterations(tmp_path) == [1, 2, 3, 4]
    assert list(small_disk.iterdir()) == []  # the failed saves left nothing behind
    assert capsys.readouterr().err.count("No space left on device") == 2


def test_full_disk_stop_raises(tmp_path: Path, small_disk: Path) -> None:
    cfg = _tiny(num_steps=4, save=str(small_disk), save_interval=2)
    with pytest.raises(CheckpointError, match=r"saving checkpoint 2 .*No space left on device"):
        run_training(plan_for_torchrun(cfg), run_dir=tmp_path)
    assert _iterations(tmp_path) == [1, 2]


def test_fp16_loss_scale_is_saved_and_restored(tmp_path: Path) -> None:
    import dataclasses

    from megatron_hpc.checkpoint.store import RankInfo, load_checkpoint

    cfg = _tiny(num_steps=3)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="fp16", log_interval=1))
    run_training(plan_for_torchrun(cfg), run_dir=tmp_path)
    # The scale starts at 2**32, far above fp16's range: the first steps overflow and halve it.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged_scale = rows[-1]["loss_scale"]
    assert logged_scale < 2.0**32
    ranks = RankInfo()
    _found, state = load_checkpoint(tmp_path / "checkpoints", ranks=ranks, io_workers_per_node=1)
    assert state["grad_scaler"]["scale"] == logged_scale
    # Resumed for two more steps: the scale continues from the saved one instead of 2**32.
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=5))
    run_training(plan_for_torchrun(more), run_dir=tmp_path)
    resumed = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][len(rows):]
    assert [r["iteration"] for r in resumed] == [4, 5]
    assert all(r["loss_scale"] <= logged_scale for r in resumed)


class _CountRandomFills:
    """An outer torch-function mode that counts the random fills reaching it."""

    def __init__(self) -> None:
        import torch
        from torch.overrides import TorchFunctionMode

        counter = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.normal_:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count = 0
        self.mode = Mode()


def test_resume_does_not_draw_the_initial_weights(tmp_path: Path) -> None:
    fresh = _CountRandomFills()
    with fresh.mode:
        run_training(plan_for_torchrun(_tiny(num_steps=2)), run_dir=tmp_path)
    assert fresh.count > 0  # every weight matrix is drawn once on a fresh start
    resumed = _CountRandomFills()
    with resumed.mode:
        run_training(plan_for_torchrun(_tiny(num_steps=3)), run_dir=tmp_path)
    assert resumed.count == 0
    assert _iterations(tmp_path) == [1, 2, 3]  # and it continued from iteration 2


def _lrs(run_dir: Path) -> list[float]:
    return [json.loads(line)["applied_lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resuming_with_more_steps_keeps_the_decay_horizon_that_submit_pins(tmp_path: Path) -> None:
    """`submit --resume --set train.num_steps=8` writes optim.lr_decay_iters=4 (launch/resume.py keep_lr_horizon);
    the trainer's LR (from the plan) then stays at min_lr past the old end instead of climbing back up."""
    import dataclasses

    from megatron_hpc.launch.resume import keep_lr_horizon

    base = _tiny(num_steps=4)
    base = dataclasses.replace(base, optim=OptimConfig(lr=3e-3, min_lr=3e-4, lr_decay_style="cosine"),
                               train=dataclasses.replace(base.train, log_interval=1))
    for name, pinned in (("pinned", True), ("stretched", False)):
        run_dir = tmp_path / name
        run_training(plan_for_torchrun(base), run_dir=run_dir)
        extra, note = keep_lr_horizon(dataclasses.asdict(base), ["train.num_steps=8"]) if pinned else ([], None)
        assert (extra, bool(note)) == ((["optim.lr_decay_iters=4"], True) if pinned else ([], False))
        optim = dataclasses.replace(base.optim, lr_decay_iters=4 if pinned else None)
        more = dataclasses.replace(base, optim=optim, train=dataclasses.replace(base.train, num_steps=8))
        run_training(plan_for_torchrun(more), run_dir=run_dir)
    pinned, stretched = _lrs(tmp_path / "pinned"), _lrs(tmp_path / "stretched")
    assert pinned[:4] == stretched[:4]
    assert pinned[4:] == pytest.approx([3e-4] * 4)  # past the horizon: min_lr, never above the last LR
    assert stretched[4] > 2 * stretched[3]  # what an unpinned resume does: the cosine restarts higher
