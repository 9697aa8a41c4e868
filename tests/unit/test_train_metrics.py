"""Megatron's iteration line, its JSONL twin and the FLOPs formula."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from datetime import datetime
from pathlib import Path

import pytest

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.plan.model_math import flops_per_token
from megatron_hpc.run_folder import read_metrics
from megatron_hpc.train.metrics import (
    IterationRecord,
    MetricsLogger,
    format_iteration_line,
    parse_iteration_line,
)

REC = IterationRecord(iteration=5, train_iters=20, consumed_samples=40, elapsed_ms=123.44, lr=1e-4,
                      global_batch_size=8, lm_loss=7.0123449, grad_norm=1.2341, tokens_per_s=1.0,
                      tflops_per_worker=0.12, num_skipped_iterations=0, num_nan_iterations=0, phase="run")


def test_line_matches_megatron_layout() -> None:
    # Hand-written from megatron-and-launchers.md 4.1 (timestamped, log-throughput version).
    want = (" [2025-01-02 03:04:05.000006] iteration        5/      20 | consumed samples:           40 |"
            " elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 0.1 |"
            " learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 7.012345E+00 |"
            " loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |"
            " number of nan iterations:   0 |")
    assert format_iteration_line(REC, now=datetime(2025, 1, 2, 3, 4, 5, 6)) == want


def test_line_of_skipped_steps_leaves_out_loss_and_grad_norm_as_megatron() -> None:
    # An fp16 interval whose steps all overflowed: Megatron's training_log prints no lm loss (its average over
    # zero advanced iterations fails `avg > 0.0`) and no grad norm (the optimizer returned None); never "NAN".
    rec = dataclasses.replace(REC, lm_loss=math.nan, grad_norm=math.nan, loss_scale=2.0**32,
                              num_skipped_iterations=1)
    want = (" [2025-01-02 03:04:05.000006] iteration        5/      20 | consumed samples:           40 |"
            " elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 0.1 |"
            " learning rate: 1.000000E-04 | global batch size:     8 |"
            " loss scale: 4294967296.0 | number of skipped iterations:   1 |"
            " number of nan iterations:   0 |")
    assert format_iteration_line(rec, now=datetime(2025, 1, 2, 3, 4, 5, 6)) == want


def test_line_parses_into_fields() -> None:
    fields = parse_iteration_line(format_iteration_line(REC, now=datetime(2025, 1, 2)))
    assert fields["iteration"] == "5/20"
    assert int(fields["consumed samples"]) == 40
    assert float(fields["learning rate"]) == pytest.approx(1e-4)
    assert float(fields["lm loss"]) == pytest.approx(7.012345)
    assert float(fields["grad norm"]) == pytest.approx(1.234)
    assert int(fields["global batch size"]) == 8
    assert float(fields["elapsed time per iteration (ms)"]) == pytest.approx(123.4)
    assert float(fields["throughput per GPU (TFLOP/s/GPU)"]) == pytest.approx(0.1)


def test_flops_matches_classic_form_and_worked_example() -> None:
    m = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32)
    n_layer, h, s, v = 3, 64, 32, 512
    assert flops_per_token(m, padded_vocab=v) == pytest.approx(72 * n_layer * h * h + 12 * n_layer * h * s + 6 * h * v)
    # GPT-3 6.7B: 43.11 GFLOP/token (reference 4.4).
    big = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                      max_position_embeddings=2048)
    assert flops_per_token(big, padded_vocab=50304) / 1e9 == pytest.approx(43.11, abs=0.01)


def test_logger_prints_on_last_rank_and_appends_jsonl(tmp_path: Path) -> None:
    m = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=4, max_position_embeddings=4)
    out = io.StringIO()
    logger = MetricsLogger(model=m, padded_vocab=16, world_size=2, train_iters=3, global_batch_size=4,
                           phase="compile", log_interval=2, enabled=True, run_dir=tmp_path, out=out)
    assert [logger.should_log(i) for i in (1, 2, 3)] == [False, True, True]
    logger.log(2, lr=0.5, lm_loss=2.0, grad_norm=0.25, num_nan=0)
    logger.log(3, lr=0.25, lm_loss=1.5, grad_norm=0.5, num_nan=0)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [2, 3]
    assert set(rows[0]) == {"iteration", "consumed_samples", "elapsed_ms", "lr", "global_batch_size", "lm_loss",
                            "grad_norm", "tokens_per_s", "tflops_per_worker", "num_skipped_iterations", "phase",
                            "loss_scale", "warmup", "applied_lr"}
    assert rows[1]["consumed_samples"] == 12 and rows[1]["phase"] == "compile"
    assert [r["warmup"] for r in rows] == [True, False]  # steps 1-2 are warm-up, step 3 is not
    assert [parse_iteration_line(x)["lm loss"] for x in out.getvalue().splitlines()] == ["2.000000E+00",
                                                                                     "1.500000E+00"]
    quiet = MetricsLogger(model=m, padded_vocab=16, world_size=2, train_iters=3, global_batch_size=4,
                          phase="run", log_interval=1, enabled=False, run_dir=tmp_path / "x", out=out)
    quiet.log(1, lr=0.5, lm_loss=2.0, grad_norm=0.25, num_nan=0)
    assert len(out.getvalue().splitlines()) == 2 and not (tmp_path / "x").exists()


def test_a_row_cut_by_a_killed_writer_does_not_take_the_resumed_runs_first_row_with_it(tmp_path: Path) -> None:
    # What a rank 0 killed in the middle of its write leaves (SIGKILL lands between the pages a write spans): a row
    # without its newline. The resumed attempt's first row must not be glued to it.
    m = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=4, max_position_embeddings=4)
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1, "phase": "run", "lm_loss": 2.5}\n{"iteration": 2, "ph')
    logger = MetricsLogger(model=m, padded_vocab=16, world_size=1, train_iters=3, global_batch_size=4, phase="run",
                           log_interval=1, enabled=True, run_dir=tmp_path, out=io.StringIO())
    logger.log(2, lr=0.5, lm_loss=2.0, grad_norm=0.25, num_nan=0)
    logger.log(3, lr=0.5, lm_loss=1.5, grad_norm=0.25, num_nan=0)
    assert [r.iteration for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
