"""`megatron-hpc tune --cluster local`: one job through the launcher (node.sh, torchrun, 2 gloo workers) runs the
three layouts of a 2-layer model for a few steps and the collective and GEMM micro-benchmarks, keeps the refitted
calibration, and a later `plan` predicts from it; then `submit --tune --dry-run` writes the tune job only."""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

SMALL = ["--set", "launch.workers_per_node=2", "--set", "data.source=synthetic", "--set", "parallel.tensor=0",
         "--set", "parallel.pipeline=0", "--set", "model.num_layers=2", "--set", "model.hidden_size=64",
         "--set", "model.vocab_size=512", "--set", "compile.num_steps=5"]


def test_tune_measures_every_layout_keeps_the_calibration_and_plan_uses_it(cli_in_process, tmp_path: Path,
                                                                            own_compile_cache: Path):
    out = tmp_path / "tune"
    done = cli_in_process("tune", "--recipe", "tiny", *SMALL, "--cluster", "local", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    rows = result["candidates"]
    assert {r["label"] for r in rows} == {"TP 1 x PP 1 x DP 2", "TP 2 x PP 1 x DP 1", "TP 1 x PP 2 x DP 1"}
    assert all(r["measured_s"] > 0 and r["predicted_after_s"] > 0 for r in rows)
    for r in rows:  # every step after the 2 warm-up steps timed (CPU), the median counted
        assert len(r["measured_steps_s"]) == 3 and r["measured_s"] == statistics.median(r["measured_steps_s"])
        assert 0.0 <= r["other_cpu_share"] <= 1.0  # other processes' share of the node's CPU during the trial
    fastest = min(rows, key=lambda r: r["measured_s"])
    assert result["winner"] == {"label": fastest["label"], "overlay": fastest["overlay"]}
    overlay = (out / "tune-overlay.txt").read_text().strip()
    assert shlex.split(overlay)[1::2] == fastest["overlay"]
    assert len(result["benchmark"]) == 9 and all(b["measured_s"] > 0 for b in result["benchmark"])
    # Every distinct product of the three layouts' ranks (TP 1 and TP 2 shapes), forward and backward, timed and
    # fitted with the rest.
    gemms = result["gemm_benchmark"]
    assert len(gemms) >= 2 * 7 and all(g["measured_s"] > 0 and g["predicted_after_s"] > 0 for g in gemms)
    fit = result["fit"]
    assert set(fit["rms_error_left_out_by_method"]) == {"two stages", "one stage"}
    assert fit["method"] in ("two stages", "one stage")
    assert fit["observations"] == 3 + 9 + 1 + (len(gemms) if fit["method"] == "two stages" else 0)
    # The operator chain: its count (a TorchDispatchMode's) and the time of one operator, which gives dispatch.
    (chain,) = result["op_benchmark"]
    assert chain["ops_per_chain"] > 50 and 0 < chain["measured_per_op_s"] < 0.01
    assert fit["calibration"]["op_overhead_factor"] == pytest.approx(chain["measured_per_op_s"] / 15e-6)
    kept = own_compile_cache / "megatron-hpc" / "calibrations" / "cpu.json"
    assert result["calibration_path"] == str(kept) and kept.is_file()

    # A later plan predicts each layout as the fitted calibration does (tune.json's "after"), and names it.
    plan = json.loads(cli_in_process("plan", "--recipe", "tiny", *SMALL, "--json").stdout)
    assert plan["calibration"].startswith("measured by tune ") and str(kept) in plan["calibration"]
    predicted = {f"TP {a['tensor_parallel']} x PP {a['pipeline_parallel']} x DP {a['data_parallel']}":
                 a["predicted_step_time_s"] for a in plan["layout_alternatives"]}
    predicted[f"TP {plan['tensor_parallel']} x PP {plan['pipeline_parallel']} x DP {plan['data_parallel']}"] = (
        plan["predicted_step_time_s"])
    for row in rows:
        assert predicted[row["label"]] == pytest.approx(row["predicted_after_s"], rel=0.02), row


def test_submit_tune_dry_run_writes_the_tune_job_and_no_run(cli_in_process, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done = cli_in_process("submit", "--recipe", "tiny", *SMALL, "--cluster", "local", "--tune", "--top", "2",
                          "--dry-run")
    assert done.returncode == 0, done.stderr[-3000:]
    folders = list((tmp_path / "runs").glob("*/*"))
    assert [f.parent.name for f in folders] == ["tiny-tune"]
    assert (folders[0] / "tune.sbatch").is_file() and not (folders[0] / "run.sbatch").exists()
    assert len(json.loads((folders[0] / "tune-candidates.json").read_text())["candidates"]) == 2
