"""run_training end to end in this process (a world of one), and its up-front plan checks."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.store import find_checkpoint, read_shard
from megatron_hpc.config.schema import (
    CompilePhaseConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from megatron_hpc.errors import DataError, PlanError, TrainingError
from megatron_hpc.plan.planner import check_torchrun_world
from megatron_hpc.run_folder import read_spec, write_spec
from megatron_hpc.train.entry import plan_for_torchrun, read_dist_env, run_training
from megatron_hpc.train.metrics import parse_iteration_line

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _tiny(optim: OptimConfig | None = None, **train: object) -> RunConfig:
    return RunConfig(
        name="tiny",
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                          max_position_embeddings=32, vocab_size=500),
        train=TrainConfig(**{"num_steps": 20, "micro_batch_size": 2, "global_batch_size": 8, **train}),
        optim=optim or OptimConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2),
        compile=CompilePhaseConfig(num_steps=3),
    )


def test_twenty_steps_learn(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    assert run_training(plan_for_torchrun(_tiny(log_interval=5)), run_dir=tmp_path) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [5, 10, 15, 20]
    assert rows[-1]["lm_loss"] < 0.8 * rows[0]["lm_loss"]
    assert all(r["phase"] == "run" and r["tokens_per_s"] > 0 for r in rows)
    out = capsys.readouterr().out.splitlines()
    assert "tp 1 pp 1 dp 1" in out[0] and "parameters" in out[0]
    lines = [parse_iteration_line(x) for x in out if "] iteration " in x]
    assert [x["iteration"] for x in lines] == ["5/20", "10/20", "15/20", "20/20"]
    assert float(lines[-1]["lm loss"]) == pytest.approx(rows[-1]["lm_loss"], rel=1e-6)


def test_compile_phase_runs_its_own_step_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    assert run_training(plan_for_torchrun(_tiny()), phase="compile", run_dir=tmp_path) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["phase"]) for r in rows] == [(1, "compile"), (2, "compile"), (3, "compile")]


def test_bad_global_batch_is_refused_by_the_plan_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(PlanError, match=r"train.global_batch_size=7 .*use --set train.global_batch_size=6 or 8"):
        plan_for_torchrun(_tiny(global_batch_size=7))
    assert not torch.distributed.is_initialized()


def test_plan_for_torchrun_takes_the_world_and_checks_it_once() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_PORT": "1"}
    tp2 = RunConfig(name="x", model=_tiny().model, train=_tiny().train, optim=_tiny().optim,
                    parallel=ParallelConfig(tensor=2))
    spec = plan_for_torchrun(tp2, environ=env)
    assert (spec.plan.num_nodes, spec.plan.workers_per_node, spec.plan.data_parallel) == (2, 4, 4)
    assert spec.plan.mesh.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    check_torchrun_world(spec.plan, world_size=8, local_world_size=4)
    with pytest.raises(PlanError, match=r"torchrun started 8 worker\(s\), 2 per node, but the plan .* has 8, 4 per"):
        check_torchrun_world(spec.plan, world_size=8, local_world_size=2)
    with pytest.raises(PlanError, match=r"parallel.tensor=3 is invalid .*N in \{1, 2, 4\}"):
        plan_for_torchrun(RunConfig(name="x", model=_tiny().model, train=_tiny().train, optim=_tiny().optim,
                                    parallel=ParallelConfig(tensor=3)), environ=env)


def test_a_world_of_one_leaves_the_port_to_its_store() -> None:
    # Port 0: the only rank's store binds when the world forms. A port found free beforehand was unbound until then,
    # and another process group beside it (the suite's) could take it (EADDRINUSE). The tests above train on it.
    env = read_dist_env({})
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (0, 1, "127.0.0.1", 0)


def test_trainer_follows_a_changed_plan_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan, not the config, is where the trainer reads micro-batches and the padded vocabulary."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    spec = plan_for_torchrun(_tiny(num_steps=2))
    assert (spec.plan.micro_batch_size, spec.plan.num_micro_batches, spec.plan.padded_vocab_size) == (2, 4, 512)
    write_spec(tmp_path, spec)
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan.update(micro_batch_size=1, num_micro_batches=8, padded_vocab_size=640)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert run_training(read_spec(tmp_path), run_dir=tmp_path) == 0
    banner = capsys.readouterr().out.splitlines()[0]
    assert "8 micro-batch(es) of 1" in banner and "padded vocab 640 (140 dummy)" in banner
    saved = read_shard(find_checkpoint(tmp_path / "checkpoints"), tp_rank=0)
    assert saved["model"]["wte.weight"].shape[0] == 640
    assert saved["resolved_plan"]["num_micro_batches"] == 8


def test_a_run_folder_whose_plan_does_not_fit_its_config_is_refused(tmp_path: Path) -> None:
    write_spec(tmp_path, plan_for_torchrun(_tiny(), environ={}))
    config = json.loads((tmp_path / "config.json").read_text())
    config["train"]["micro_batch_size"] = 4  # edited after planning: the plan would train something else
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match=r"config.json changed after .*plan.json was made from it"):
        read_spec(tmp_path)
    write_spec(tmp_path, plan_for_torchrun(_tiny(), environ={}))
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["num_micro_batches"] = 3  # 2 x 1 x 3 != 8
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(PlanError, match=r"inconsistent: micro_batch_size 2 x data_parallel 1 x num_micro_batches 3"):
        read_spec(tmp_path)


def test_bf16_autocast_tracks_fp32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    losses = {}
    for precision in ("fp32", "bf16"):
        run_dir = tmp_path / precision
        assert run_training(plan_for_torchrun(_tiny(precision=precision)), phase="compile", run_dir=run_dir) == 0
        losses[precision] = [json.loads(x)["lm_loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses["bf16"] != losses["fp32"]  # autocast really ran in bf16
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)


def test_non_finite_steps_are_skipped_then_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    # An absurd learning rate without clipping: the first step is finite and blows up the weights,
    # every later loss is NaN.
    exploding = OptimConfig(lr=1e30, clip_grad=0.0, lr_warmup_iters=0, lr_decay_style="constant")
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    with pytest.raises(TrainingError, match="not finite for 3 steps in a row") as info:
        run_training(plan_for_torchrun(_tiny(optim=exploding, max_skipped_steps=3, log_interval=1)), run_dir=tmp_path)
    assert "optim.lr" in str(info.value)
    # The run phase's stop handlers are gone after the error too: a leftover one would swallow the SIGTERM
    # of anything this process forks later (it hung a multiprocessing pool's terminate()).
    assert {sig: signal.getsignal(sig) for sig in before} == before
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]  # stopped at the third skipped step
    assert [r["num_skipped_iterations"] for r in rows] == [0, 1, 1]
    assert math.isfinite(rows[0]["lm_loss"])  # finite before the blow-up
    assert all(math.isnan(r["lm_loss"]) for r in rows[1:])  # no finite step was averaged in


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_any_process_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data's ids all fit 300 rows (the scan of the .bin would pass), but the tokenizer that made it has 400."""
    import dataclasses

    import numpy as np

    from megatron_hpc.data.indexed import IndexedDatasetWriter

    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
    prefix = str(tmp_path / "c_text_document")
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for i in range(40):
            writer.add_document(np.arange(i, i + 100, dtype=np.uint16))
    data = DataConfig(path=prefix, vocab_file=str(fixtures / "vocab.json"), merge_file=str(fixtures / "merges.txt"))
    cfg = dataclasses.replace(_tiny(num_steps=2), data=data)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=300))
    with pytest.raises(DataError, match=r"^model.vocab_size 300 is smaller than the 400 ids of the tokenizer "
                                        r"GPT2BPETokenizer \(.*vocab.json, .*merges.txt\).*"
                                        r"use --set model.vocab_size=400 \(the planner pads it\)$"):
        run_training(plan_for_torchrun(cfg), run_dir=tmp_path / "run")
    assert not torch.distributed.is_initialized() and not (tmp_path / "run").exists()
    fits = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=400))
    assert run_training(plan_for_torchrun(fits), phase="compile", run_dir=tmp_path / "run") == 0
