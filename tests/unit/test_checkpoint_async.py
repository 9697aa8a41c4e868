"""checkpoint.async_save: the same files as a synchronous save, written while training goes on, failures surfaced.

In this process (a world of one); tests/multiprocess/test_checkpoint_resume.py resumes an asynchronous checkpoint
at TP=2 and compares it with the synchronous one, and tests/unit/test_checkpoint_crash.py kills asynchronous saves.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_hpc.checkpoint.store import (
    AsyncSave,
    PipelineLayout,
    RankInfo,
    load_checkpoint,
    paths,
    read_manifest,
    save_checkpoint,
)
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

ONE = RankInfo()
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*TORCHRUN_VARS, "NEURON_EXTRACT_GRAPHS_ONLY"):
        monkeypatch.delenv(var, raising=False)


def _tiny(num_steps: int, *, vocab_size: int = 500, **ckpt: Any) -> RunConfig:
    return RunConfig(
        name="tiny",
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                          max_position_embeddings=32, vocab_size=vocab_size),
        train=TrainConfig(num_steps=num_steps, micro_batch_size=8, global_batch_size=8, log_interval=1),
        optim=OptimConfig(lr=3e-3),
        checkpoint=CheckpointConfig(**ckpt),
        compile=CompilePhaseConfig(num_steps=2),
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _state(value: float) -> dict:
    return {"iteration": 1, "model": {f"w{i}": torch.full((1000,), value + i) for i in range(6)},
            "optimizer": {"state": {0: {"exp_avg": torch.arange(12.0).view(3, 4).t()}}}}  # a strided view too


@pytest.mark.parametrize("in_background", [False, True], ids=["copy-at-start", "copy-on-writer"])
def test_snapshot_is_taken_at_start_and_files_equal_sync(tmp_path: Path, in_background: bool) -> None:
    sync = save_checkpoint(tmp_path / "sync", 1, _state(1.0), ranks=ONE)
    live = _state(1.0)
    pending = AsyncSave(tmp_path / "async", 1, live, ranks=ONE, fmt="xser", keep_last=0,
                        layout=PipelineLayout(pipeline=1), copy_in_background=in_background)
    pending.wait_copied()  # what the trainer's optimizer does before its step
    for t in live["model"].values():  # what the optimizer does next step, in place
        t.add_(100.0)
    assert not (tmp_path / "async" / paths.TRACKER).exists()  # nothing is committed before finish()
    folder = pending.finish()
    assert (tmp_path / "async" / paths.TRACKER).read_text() == "1"
    assert read_manifest(folder).files == read_manifest(sync).files  # every size and crc32
    _found, loaded = load_checkpoint(tmp_path / "async", ranks=ONE)
    assert torch.equal(loaded["model"]["w5"], torch.full((1000,), 6.0))


def _main_content(folder: Path) -> Any:
    """The main file's object, minus what differs between the two runs' configs on purpose."""
    _found, state = load_checkpoint(folder.parent, ranks=ONE)

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("async_save", "config_sha256")}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value.tolist() if isinstance(value, torch.Tensor) else value  # the RNG states

    return strip({k: v for k, v in state.items() if k not in ("model", "optimizer")})


def test_training_with_async_saves_writes_the_same_checkpoints(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    for name, flag in (("sync", False), ("async", True)):
        cfg = _tiny(6, save_interval=2, keep_last=5, async_save=flag)
        assert run_training(plan_for_torchrun(cfg), run_dir=tmp_path / name) == 0
    out = capsys.readouterr().out
    assert out.count("in the background") == 6  # 3 started, 3 completed
    for key in ("iteration", "lm_loss", "grad_norm", "lr"):
        assert [r[key] for r in _metrics(tmp_path / "sync")] == [r[key] for r in _metrics(tmp_path / "async")]
    for it in (2, 4, 6):
        sync, asyn = (paths.iteration_dir(tmp_path / name / "checkpoints", it) for name in ("sync", "async"))
        main = "mp_rank_00/model_optim_rng.pt"
        files_sync, files_async = read_manifest(sync).files, read_manifest(asyn).files
        assert files_sync.keys() == files_async.keys()
        # Every tensor file byte for byte; the main file holds the config, whose async_save differs.
        assert {k: v for k, v in files_sync.items() if k != main} == {k: v for k, v in files_async.items()
                                                                     if k != main}
    assert (tmp_path / "async" / "checkpoints" / paths.TRACKER).read_text() == "6"
    assert _main_content(paths.iteration_dir(tmp_path / "sync" / "checkpoints", 6)) == _main_content(
        paths.iteration_dir(tmp_path / "async" / "checkpoints", 6))
    assert not [p for p in (tmp_path / "async" / "checkpoints").iterdir() if paths.is_temp_dirname(p.name)]


def test_training_goes_on_while_the_files_are_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A state of about 150 MB (a 200k-token vocabulary, Adam moments included): its writer is still busy when the
    # loop gets control back. The writer notes, when it is done, whether save_now() had returned to the loop and
    # how many steps were completed by then (informative only: that depends on the machine's speed).
    cfg = _tiny(9, vocab_size=200_000, save_interval=3, keep_last=1, async_save=True)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_length=8, max_position_embeddings=8),
                              train=dataclasses.replace(cfg.train, micro_batch_size=1, global_batch_size=1))
    assert run_training(plan_for_torchrun(cfg), run_dir=tmp_path) == 0
    out = capsys.readouterr().out
    done = dict(re.findall(r"at iteration (\d+) \(written in the background, (.*)\)$", out, flags=re.M))
    assert set(done) == {"3", "6", "9"}, out
    assert all(re.fullmatch(r"\d+ step\(s\) completed meanwhile", how) for how in done.values()), out
    # The loop's order: each save starts, the next steps run, then the save completes.
    events = {r"> saving checkpoint (\d+) in the background": "start", r"^\s*\[.*\] iteration\s+(\d+)/": "step",
              r"> saved checkpoint .* at iteration (\d+) ": "done"}
    order = [f"{name} {m.group(1)}" for line in out.splitlines() for pattern, name in events.items()
             if (m := re.search(pattern, line))]
    assert order[order.index("start 3"):order.index("done 3") + 1] == ["start 3", "step 4", "step 5", "step 6",
                                                                     "done 3"], order


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs: about half of one checkpoint of the tiny model, so every save fails in the writer."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True, capture_output=True)
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_background_failure_stops_the_run_with_the_cause(tmp_path: Path, small_disk: Path) -> None:
    cfg = _tiny(4, save=str(small_disk), save_interval=2, async_save=True)
    with pytest.raises(CheckpointError, match=r"saving checkpoint 2 to .* failed on rank 0: No space left on device "
                                              rf"\({re.escape(str(small_disk))}/iter_0000002\.tmp-\w+/mp_rank_00/"):
        run_training(plan_for_torchrun(cfg), run_dir=tmp_path)
    assert [r["iteration"] for r in _metrics(tmp_path)] == [1, 2, 3, 4]  # surfaced at the next save
    assert list(small_disk.iterdir()) == []  # no tracker, no half-written folder


def test_background_failure_with_continue_keeps_training(tmp_path: Path, small_disk: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _tiny(4, save=str(small_disk), save_interval=2, async_save=True, on_save_failure="continue")
    assert run_training(plan_for_torchrun(cfg), run_dir=tmp_path) == 0
    assert [r["iteration"] for r in _metrics(tmp_path)] == [1, 2, 3, 4]
    assert capsys.readouterr().err.count("No space left on device") == 2
    assert list(small_disk.iterdir()) == []


def test_a_stop_completes_the_save_before_stopped_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A time budget of 0.6 ms: the run stops after its first step, whose save (save_interval 1) is in flight.
    cfg = _tiny(6, save_interval=1, async_save=True, time_budget_min=1e-5)
    assert run_training(plan_for_torchrun(cfg), run_dir=tmp_path) == 0
    out = capsys.readouterr().out
    assert -1 < out.find("> saved checkpoint") < out.find("> stopping at iteration 1"), out  # before stopped.json
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    root = tmp_path / "checkpoints"
    assert (stopped["iteration"], stopped["checkpoint"]) == (1, str(paths.iteration_dir(root, 1)))
    assert (root / paths.TRACKER).read_text() == "1"
    assert read_manifest(paths.iteration_dir(root, 1)).iteration == 1
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", paths.TRACKER]


def test_an_unwritable_folder_fails_at_the_start(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")  # a file where the checkpoint folder should be
    with pytest.raises(CheckpointError, match=r"saving checkpoint 1 to .*/file failed on rank 0: (File exists|Not a "
                                              r"directory)"):
        AsyncSave(tmp_path / "file", 1, _state(1.0), ranks=ONE, fmt="xser", keep_last=0,
                  layout=PipelineLayout(pipeline=1))


def test_a_failing_run_lets_the_writer_finish_and_commits_nothing_new(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_hpc.errors import TrainingError

    # lr 1e30: step 1 applies, steps 2 and 3 are not finite, and the run stops with an error while save 2 is in
    # flight. Other ranks may never reach a commit then, so none is attempted; the writer still finishes its files.
    cfg = _tiny(8, save_interval=1, async_save=True, keep_last=5)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e30),
                              train=dataclasses.replace(cfg.train, max_skipped_steps=2))
    with pytest.raises(TrainingError, match="not finite for 2 steps"):
        run_training(plan_for_torchrun(cfg), run_dir=tmp_path)
    assert "checkpoint 2 was not completed" in capsys.readouterr().err
    root = tmp_path / "checkpoints"
    assert (root / paths.TRACKER).read_text() == "1"
    temps = [p for p in root.iterdir() if paths.is_temp_dirname(p.name)]
    assert [p.name.split(".")[0] for p in temps] == ["iter_0000002"]
    assert (temps[0] / "mp_rank_00.files.json").is_file()  # the writer's last file: it finished
    _found, state = load_checkpoint(root, ranks=ONE)
    assert state["iteration"] == 1
