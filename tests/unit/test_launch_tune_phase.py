"""The tune phase (plan/jobs.py make_tune_phase): a graphs-only pass under the compiler wrapper first where a run
would compile. How a trial times its steps (launch/tune_job.py trial_log_interval with train/metrics.py's log rule):
every step on CPU, where reading a step is free; on CUDA and XLA blocks of steps, one host sync at each end, the
warm-up untimed. The intervals are those the trainer's own MetricsLogger records."""

from __future__ import annotations

import dataclasses
import io

import pytest
from megatron_hpc.launch.tune_job import (
    WARMUP_STEPS,
    finish_tune,
    plan_candidates,
    trial_log_interval,
    write_request,
)

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.plan.calibration import DEFAULT_CALIBRATION
from megatron_hpc.plan.calibration_fit import Parts, Scales
from megatron_hpc.plan.jobs import make_tune_phase
from megatron_hpc.plan.planner import make_plan
from megatron_hpc.train.metrics import MetricsLogger


def logged_intervals(num_steps: int, interval: int) -> list[tuple[int, int, bool]]:
    """(first step, last step, warm-up) of each interval the trainer logs in a trial of num_steps steps."""
    cfg = load_recipe("tiny", [])
    metrics = MetricsLogger(model=cfg.model, padded_vocab=cfg.model.vocab_size, world_size=1, train_iters=num_steps,
                            global_batch_size=8, phase="compile", log_interval=interval, enabled=False, run_dir=None,
                            out=io.StringIO())
    metrics.reset_clock(0)
    found, start = [], 1
    for step in range(1, num_steps + 1):
        if metrics.should_log(step):
            rec = metrics.log(step, lr=1e-3, lm_loss=1.0, grad_norm=1.0, num_nan=0)
            found.append((start, step, rec.warmup))
            start = step + 1
    return found


def test_cpu_trials_time_every_step_after_the_warm_up():
    assert trial_log_interval(8, backend="gloo") == 1
    intervals = logged_intervals(8, 1)
    assert [i for i in intervals if not i[2]] == [(s, s, False) for s in range(WARMUP_STEPS + 1, 9)]


@pytest.mark.parametrize("backend", ["nccl", "xla"])
@pytest.mark.parametrize("num_steps", [4, 5, 8, 12, 30])
def test_asynchronous_trials_time_blocks_with_one_sync_at_each_end(backend, num_steps):
    interval = trial_log_interval(num_steps, backend=backend)
    assert interval > 1  # not a host sync every step
    intervals = logged_intervals(num_steps, interval)
    assert all(last > first for first, last, _ in intervals)  # one sync per two steps or more, never per step
    warm = [i for i in intervals if i[2]]
    timed = [i for i in intervals if not i[2]]
    assert warm == [(1, interval, True)] and interval >= WARMUP_STEPS  # the warm-up stays untimed
    assert timed and timed[-1][1] == num_steps  # every later step is in a timed block
    if num_steps >= 3 * WARMUP_STEPS:
        assert len(timed) >= 2  # a median of blocks, not one block


def test_trial_configs_carry_the_platform_log_interval():
    platform = get_platform("cpu")
    sets = ["launch.workers_per_node=2", "data.source=synthetic", "parallel.tensor=0", "parallel.pipeline=0",
            "compile.num_steps=8"]
    cfg = load_recipe("tiny", sets)
    plan = make_plan(cfg, num_nodes=1, platform=platform)
    found = plan_candidates("tiny", sets, plan=plan, platform=platform, top=2, calibration=DEFAULT_CALIBRATION)
    assert [c.spec.config.train.log_interval for c in found] == [1, 1]
    assert cfg.train.log_interval == 10  # the recipe's own, which the run keeps


@pytest.mark.parametrize(("recipe", "platform", "sets", "wrapper"), [
    ("gpt3_1.7b", "trn1", [], ("neuron_parallel_compile",)),  # pass 1 under the compiler wrapper, then timed
    ("gpt3_1.7b", "trn1", ["compile.enabled=false"], ()),  # the run would get no compile phase: one timed pass
    ("gpt3_1.7b", "p5", [], ()),
    ("tiny", "cpu", [], ()),
])
def test_the_tune_phase_carries_the_compile_wrapper_where_a_run_would_compile(recipe, platform, sets, wrapper):
    cfg = load_recipe(recipe, ["data.source=synthetic", *sets])
    plan = make_plan(cfg, num_nodes=1, platform=get_platform(platform))
    spec = make_tune_phase(cfg, plan, get_platform(platform), extra_env={})
    assert spec.phase == "tune" and spec.torchrun_wrapper == wrapper and not spec.requeue


def test_tune_fits_the_gemm_curve_from_the_products_and_says_which_fit_it_kept(tmp_path):
    """Measurements made by hand from known scales (trials, collectives and the request's products): the fit in two
    stages predicts every trial left out exactly, while the one-stage fit, given two trials for compute and the
    fixed cost, cannot; tune keeps the two-stage fit and says so. Without the products' times it fits in one."""
    platform = get_platform("cpu")
    sets = ["launch.workers_per_node=2", "data.source=synthetic", "parallel.tensor=0", "parallel.pipeline=0",
            "compile.num_steps=8"]
    plan = make_plan(load_recipe("tiny", sets), num_nodes=1, platform=platform)
    found = plan_candidates("tiny", sets, plan=plan, platform=platform, top=3, calibration=DEFAULT_CALIBRATION)
    request = write_request(tmp_path, found, platform=platform, calibration=DEFAULT_CALIBRATION,
                            cache_root=tmp_path / "cache", cluster="local")
    assert len(request["gemm_benchmark"]) == len(request["gemm_parts"]) > 2 * 7
    truth = Scales(compute=30.0, overhead=200.0, memory=5.0, bandwidth=2.0, latency=4.0, dispatch=3.0)
    at = [Parts(**p).at(truth) for p in request["benchmark_parts"]]
    steps = [[Parts(**c["parts"]).at(truth)] * 3 for c in request["candidates"]]
    gemm = [Parts(**p).at(truth) for p in request["gemm_parts"]]
    op_s = [Parts(**request["op_parts"]).at(truth), 90.0]  # 45 us per operator, 3x CPU's built-in 15 us
    assert op_s[0] == pytest.approx(45e-6)
    result = finish_tune(tmp_path, request, steps_s=steps, bench_s=at, finished_at_s=0.0, gemm_s=gemm, op_s=op_s)
    assert result["op_benchmark"][0]["predicted_after_s"] == pytest.approx(45e-6)
    assert result["fit"]["calibration"]["op_overhead_factor"] == pytest.approx(3.0)
    assert result["fit"]["method"] == "two stages"
    assert result["fit"]["scales"] == pytest.approx(dataclasses.asdict(truth), rel=1e-6)
    scores = result["fit"]["rms_error_left_out_by_method"]
    assert scores["two stages"] == pytest.approx(0.0, abs=1e-9) and scores["one stage"] > 0.01
    assert all(abs(r["error_left_out"]) < 1e-9 for r in result["candidates"])
    assert [g["measured_s"] for g in result["gemm_benchmark"]] == gemm
    old = finish_tune(tmp_path, request, steps_s=steps, bench_s=at, finished_at_s=0.0)
    assert old["fit"]["method"] == "one stage" and old["gemm_benchmark"] == []

