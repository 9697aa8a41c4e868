"""Calibrations kept in the shared cache (compile_cache/calibrations.py) and how `plan` and `tune` use them."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
from megatron_hpc.compile_cache import calibrations

from megatron_hpc.errors import CompileCacheError
from megatron_hpc.plan.calibration import DEFAULT_CALIBRATION

TINY = ["--set", "launch.workers_per_node=2", "--set", "data.source=synthetic", "--set", "parallel.tensor=0",
        "--set", "parallel.pipeline=0"]


def _stored(*, age_days: float = 1.0, runtime: str = "cpu", workers: int = 2, versions=None, hardware="cpu"):
    cal = dataclasses.replace(DEFAULT_CALIBRATION, source="t", gemm_peak_fraction=0.1, collective_latency_factor=8.0)
    return calibrations.StoredCalibration(
        calibration=cal, hardware=hardware, runtime=runtime, workers_per_node=workers,
        measured_at_s=time.time() - age_days * 86400, versions=versions or calibrations.software_versions(),
        run_dir="/runs/tiny-tune/1")


def test_kept_and_found(tmp_path: Path):
    assert calibrations.find(tmp_path, "cpu") is None  # tune never ran here
    path = calibrations.keep(tmp_path, _stored())
    assert path == tmp_path / "megatron-hpc" / "calibrations" / "cpu.json"
    found = calibrations.find(tmp_path, "cpu")
    assert found is not None and found.path == path
    assert found.calibration.gemm_peak_fraction == 0.1 and found.calibration.collective_latency_factor == 8.0
    assert calibrations.usable(found, hardware="cpu", now_s=time.time(), runtime="cpu", workers_per_node=2,
                               versions=calibrations.software_versions()) is None


@pytest.mark.parametrize(("stored", "expected"), [
    (dict(age_days=31), "31 days old (over 30)"),
    (dict(runtime="trn1"), "measured on trn1 with 2 workers per node, this plan runs cpu with 2"),
    (dict(workers=8), "with 8 workers per node, this plan runs cpu with 2"),
    (dict(versions={"torch": "2.0.0", "megatron_hpc": "0.0.1"}), "torch 2.0.0 -> "),
    (dict(age_days=-3), "is dated 72.0 h after this machine's clock, so its age is unknown"),
    (dict(hardware="p5"), "holds the calibration of p5, not cpu"),  # another hardware's file copied here
])
def test_stale_or_foreign_is_one_line_with_the_fix(stored, expected):
    problem = calibrations.usable(_stored(**stored), hardware="cpu", now_s=time.time(), runtime="cpu",
                                  workers_per_node=2, versions=calibrations.software_versions())
    assert problem is not None and expected in problem
    assert "re-run `megatron-hpc tune`" in problem and "\n" not in problem


def test_unreadable_calibration_says_what_to_do(tmp_path: Path):
    path = calibrations.calibration_path(tmp_path, "cpu")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"hardware": "cpu"}))
    with pytest.raises(CompileCacheError, match="delete it and re-run `megatron-hpc tune`"):
        calibrations.find(tmp_path, "cpu")


def test_plan_predicts_from_a_kept_calibration_and_names_it(cli_in_process, own_compile_cache: Path):
    before = json.loads(cli_in_process("plan", "--recipe", "tiny", *TINY, "--json").stdout)
    calibrations.keep(own_compile_cache, _stored(age_days=3))
    after = cli_in_process("plan", "--recipe", "tiny", *TINY, "--json")
    data = json.loads(after.stdout)
    assert data["calibration"].startswith("measured by tune 3 days ago (") and "cpu.json" in data["calibration"]
    assert data["predicted_step_time_s"] > 3 * before["predicted_step_time_s"]  # peak fraction 0.85 -> 0.1
    shown = cli_in_process("plan", "--recipe", "tiny", *TINY)
    assert "calibration: measured by tune 3 days ago" in shown.stdout


def test_plan_warns_about_a_stale_calibration_and_uses_the_defaults(cli_in_process, own_compile_cache: Path):
    calibrations.keep(own_compile_cache, _stored(age_days=40))
    result = cli_in_process("plan", "--recipe", "tiny", *TINY)
    assert result.returncode == 0
    assert "calibration: built-in defaults" in result.stdout
    warning = [ln for ln in result.stderr.splitlines() if "40 days old" in ln]
    assert len(warning) == 1 and "re-run `megatron-hpc tune`" in warning[0]


def test_tune_refuses_top_0_and_too_few_trial_steps_set_by_hand(cli_in_process, tmp_path: Path):
    result = cli_in_process("tune", "--recipe", "tiny", *TINY, "--top", "0", "--cluster", "local", "--dry-run",
                            "--out", str(tmp_path / "a"))
    assert result.returncode == 1 and "--top 0" in result.stderr and "use --top 3" in result.stderr
    result = cli_in_process("tune", "--recipe", "tiny", *TINY, "--set", "compile.num_steps=3", "--cluster", "local",
                            "--dry-run", "--out", str(tmp_path / "b"))
    assert result.returncode == 1 and "--set compile.num_steps=6" in result.stderr
    assert not (tmp_path / "b").exists()


def test_tune_of_a_recipe_with_too_few_compile_steps_runs_its_own_trial_steps(cli_in_process, tmp_path: Path):
    """tiny's compile phase is 3 steps, too few to time after 2 warm-up ones: the issue's plain `tune --recipe tiny`
    runs 6-step trials and says so, and says when fewer layouts exist than --top asked for."""
    out = tmp_path / "tune"
    result = cli_in_process("tune", "--recipe", "tiny", "--nodes", "1", "--top", "5", "--set",
                            "launch.workers_per_node=2", "--set", "parallel.tensor=0", "--set", "parallel.pipeline=0",
                            "--cluster", "local", "--dry-run", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "3 layouts x 6 steps" in result.stdout
    assert "trials run 6 steps: the recipe's compile.num_steps=3" in result.stdout
    assert "only 3 valid layouts at this size (--top 5 asked)" in result.stdout
    request = json.loads((out / "tune-candidates.json").read_text())
    assert request["trial_steps"] == 6


def test_tune_dry_run_writes_one_tune_job_of_the_best_layouts(cli_in_process, tmp_path: Path):
    out = tmp_path / "tune"
    result = cli_in_process("tune", "--recipe", "tiny", *TINY, "--set", "compile.num_steps=6", "--top", "2",
                            "--cluster", "local", "--dry-run", "--out", str(out))
    assert result.returncode == 0, result.stderr
    request = json.loads((out / "tune-candidates.json").read_text())
    labels = [c["label"] for c in request["candidates"]]
    assert len(labels) == 2 and labels[0] == "TP 1 x PP 1 x DP 2"  # the fastest predicted first
    assert request["candidates"][0]["overlay"] == ["parallel.tensor=1", "parallel.pipeline=1"]
    assert {op for op, _ in request["benchmark"]} == {"all_reduce", "all_gather", "send_recv"}
    assert (out / "tune.sbatch").read_text().rstrip().endswith("node.sh tune")
    assert not (out / "run.sbatch").exists() and not (out / "compile.sbatch").exists()
