"""`megatron-hpc report`: the series it takes from metrics.jsonl, and the PNG it writes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from megatron_hpc.cli.main import main
from megatron_hpc.cli.report_cmd import read_series

# Written by hand in the layout train/metrics.py appends: a compile trial, a run whose first two
# intervals are warm-up, a validation row, a NaN interval, and step 3 logged again after a resume.
ROWS = [
    {"iteration": 1, "lm_loss": 9.0, "lr": 0.0, "tokens_per_s": 10.0, "phase": "compile", "warmup": True},
    {"iteration": 1, "lm_loss": 6.0, "lr": 1e-4, "tokens_per_s": 5.0, "phase": "run", "warmup": True},
    {"iteration": 2, "lm_loss": 5.0, "lr": 2e-4, "tokens_per_s": 50.0, "phase": "run", "warmup": True},
    {"iteration": 2, "lm_loss": 5.5, "lm_loss_ppl": 244.7, "phase": "valid", "train_phase": "run"},
    {"iteration": 3, "lm_loss": 4.0, "lr": 3e-4, "tokens_per_s": 100.0, "phase": "run", "warmup": False},
    {"iteration": 4, "lm_loss": float("nan"), "lr": 3e-4, "tokens_per_s": 110.0, "phase": "run", "warmup": False},
    {"iteration": 3, "lm_loss": 3.9, "lr": 3e-4, "tokens_per_s": 90.0, "phase": "run", "warmup": True},
    {"iteration": 4, "lm_loss": 3.5, "lm_loss_ppl": 33.1, "phase": "valid", "train_phase": "run"},
]


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + '{"iteration": 5, "lm')
    return run


def test_series_come_from_the_jsonl(tmp_path: Path) -> None:
    series = read_series(_run_dir(tmp_path) / "metrics.jsonl")
    assert series.phase == "run"
    assert series.train_loss == [(1, 6.0), (2, 5.0), (3, 3.9)]  # NaN dropped, the later step 3 wins
    assert series.valid_loss == [(2, 5.5), (4, 3.5)]
    assert series.lr == [(1, 1e-4), (2, 2e-4), (3, 3e-4), (4, 3e-4)]
    assert series.tokens_per_s == [(4, 110.0)]  # warm-up intervals left out


def test_report_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_dir(tmp_path)
    out = tmp_path / "plot.png"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (800, 900)  # 8 x 9 inches at 100 dpi
    assert len(data) > 10_000
    assert main(["report", str(run)]) == 0
    assert (run / "report.png").stat().st_size > 0


def test_report_without_rows_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert main(["report", str(run)]) == 1
    assert "no iteration rows" in capsys.readouterr().err
