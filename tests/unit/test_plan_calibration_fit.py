"""The refit of the step-time model (plan/calibration_fit.py) against measurements made by hand from known scales."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import resolve_platform
from megatron_hpc.errors import PlanError
from megatron_hpc.plan.calibration import DEFAULT_CALIBRATION
from megatron_hpc.plan.calibration_fit import (
    CollectiveSample,
    Observation,
    Parts,
    Scales,
    collective_parts,
    disturbance_line,
    fit_dispatch,
    fit_scales,
    fit_two_stage,
    gemm_parts,
    node_mismatch,
    op_parts,
    other_work_share,
    parts_of,
    refit,
    scaled,
    trial_time,
)
from megatron_hpc.plan.layout_choice import predict, rank_layouts
from megatron_hpc.plan.planner import hardware_of

TINY = ["launch.workers_per_node=2", "data.source=synthetic", "parallel.tensor=0", "parallel.pipeline=0"]


@pytest.fixture(scope="module")
def layouts():
    cfg = load_recipe("tiny", TINY)
    platform = resolve_platform(None, default="cpu")
    hw = hardware_of(platform)
    ranked = rank_layouts(cfg, platform, num_nodes=1, per_node=2, hardware=hw, calibration=DEFAULT_CALIBRATION)
    assert {r.label for r in ranked} == {"TP 1 x PP 1 x DP 2", "TP 2 x PP 1 x DP 1", "TP 1 x PP 2 x DP 1"}
    return cfg, hw, ranked


def _predictor(cfg, hw, ranked):
    return lambda cal: predict(cfg, ranked.sizes, hardware=hw, calibration=cal).step_time_s


def test_parts_are_the_model_at_any_scales(layouts):
    """The split read off the model predicts what the model itself says at a scaled calibration."""
    cfg, hw, ranked = layouts
    scales = Scales(compute=3.0, overhead=40.0, memory=7.0, bandwidth=2.5, latency=6.0, dispatch=9.0)
    for r in ranked:
        parts = parts_of(_predictor(cfg, hw, r), DEFAULT_CALIBRATION)
        assert parts.compute_s > 0 and parts.overhead_s > 0 and parts.memory_s > 0 and parts.dispatch_s > 0
        direct = _predictor(cfg, hw, r)(scaled(DEFAULT_CALIBRATION, scales))
        assert parts.at(scales) == pytest.approx(direct, rel=1e-9)
    tp2 = next(r for r in ranked if r.sizes.mesh.tensor_parallel == 2)
    assert parts_of(_predictor(cfg, hw, tp2), DEFAULT_CALIBRATION).latency_s > 0  # TP all-reduces per layer


def test_refit_recovers_known_scales_from_trials_and_collectives(layouts):
    """Times made by hand from known scales (the trials' from the model, the collectives' by the ring formula):
    the fit finds the scales and the refitted calibration predicts every trial exactly."""
    cfg, hw, ranked = layouts
    truth = Scales(compute=4.0, overhead=120.0, memory=4.0, bandwidth=2.0, latency=5.0)  # one fit ties memory
    trials = [Observation(label=r.label, parts=(p := parts_of(_predictor(cfg, hw, r), DEFAULT_CALIBRATION)),
                          measured_s=p.at(truth)) for r in ranked]
    bench = []
    for op in ("all_reduce", "all_gather", "send_recv"):
        for nbytes in (1 << 17, 1 << 21):
            # By hand: ring passes (ranks - 1) x steps, each the latency and nbytes / ranks at 5 GB/s x 0.8.
            passes = {"all_reduce": 2, "all_gather": 1, "send_recv": 1}[op]
            per_pass = nbytes / (1 if op == "send_recv" else 2)
            seconds = passes * (50e-6 * truth.latency + per_pass / (5e9 * 0.8) * truth.bandwidth)
            sample = CollectiveSample(op=op, ranks=2, nbytes=nbytes, seconds=seconds)
            parts = collective_parts(sample, hardware=hw, base=DEFAULT_CALIBRATION, workers_per_node=2)
            bench.append(Observation(label=op, parts=parts, measured_s=seconds))
    fit = refit(DEFAULT_CALIBRATION, trials + bench, source="test")
    assert fit.held == ()
    for got, want in zip(fit.scales.vector(), truth.vector()):
        assert got == pytest.approx(want, rel=1e-6)
    for r, t in zip(ranked, trials):
        assert _predictor(cfg, hw, r)(fit.calibration) == pytest.approx(t.measured_s, rel=1e-6)
    assert fit.calibration.source == "test"
    assert fit.calibration.gemm_peak_fraction == pytest.approx(0.85 / 4.0)


def test_a_products_parts_by_hand():
    # 2 GFLOP at 1 TFLOP/s is 2 ms ideal; at 85% of peak 2.353 ms, plus the 10 us fixed cost over 0.85.
    parts = gemm_parts(2e9, peak_flops=1e12, base=DEFAULT_CALIBRATION)
    assert parts.compute_s == pytest.approx(2e-3 / 0.85) and parts.overhead_s == pytest.approx(10e-6 / 0.85)
    assert parts.at(Scales()) == pytest.approx(2e9 / (1e12 * DEFAULT_CALIBRATION.gemm_fraction(2e9, 1e12)))


def test_two_stages_recover_the_gemm_curve_from_products_and_the_rest_from_trials(layouts):
    """Products timed from a known curve give compute and overhead, which the trials alone cannot tell apart; the
    trials and collectives then give memory, bandwidth and latency; every trial is predicted exactly."""
    cfg, hw, ranked = layouts
    truth = Scales(compute=40.0, overhead=300.0, memory=9.0, bandwidth=2.0, latency=5.0)
    gemms = []
    for flops in (1e6, 1e8, 1e10):
        parts = gemm_parts(flops, peak_flops=1e12, base=DEFAULT_CALIBRATION)
        # By hand: (flops / 1e12 x 40 + 10 us x 300) / 0.85.
        seconds = (flops / 1e12 * 40.0 + 10e-6 * 300.0) / 0.85
        gemms.append(Observation(label=f"{flops:g}", parts=parts, measured_s=seconds))
    trials = [Observation(label=r.label, parts=(p := parts_of(_predictor(cfg, hw, r), DEFAULT_CALIBRATION)),
                          measured_s=p.at(truth)) for r in ranked]
    sample = CollectiveSample(op="all_reduce", ranks=2, nbytes=1 << 20, seconds=0.0)
    bench = [Observation(label="ar", parts=(p := collective_parts(sample, hardware=hw, base=DEFAULT_CALIBRATION,
                                                                  workers_per_node=2)), measured_s=p.at(truth))]
    scales, held = fit_two_stage(gemms, trials + bench)
    assert held == ()
    for got, want in zip(scales.vector(), truth.vector()):
        assert got == pytest.approx(want, rel=1e-6)
    fit = refit(DEFAULT_CALIBRATION, trials + bench, source="t", gemms=gemms)
    assert fit.scales == scales and fit.observations == 7
    assert fit.calibration.gemm_peak_fraction == pytest.approx(0.85 / 40.0)
    assert fit.calibration.gemm_overhead_s == pytest.approx(10e-6 * 300.0 / 40.0)
    assert fit.calibration.memory_bandwidth_fraction == pytest.approx(0.7 / 9.0)
    for r, t in zip(ranked, trials):
        assert _predictor(cfg, hw, r)(fit.calibration) == pytest.approx(t.measured_s, rel=1e-6)


def test_the_gemm_curve_is_fitted_in_time_not_per_product():
    """A step is mostly its largest products: two small ones 10x the prediction and a large one 40x give the large
    one's scale nearly, by hand sum(p m) / sum(p^2), not the mean of the ratios (20x)."""
    obs = [Observation(label="s1", parts=Parts(compute_s=1e-4), measured_s=1e-3),
           Observation(label="s2", parts=Parts(compute_s=1e-4), measured_s=1e-3),
           Observation(label="big", parts=Parts(compute_s=1e-2), measured_s=0.4)]
    scales, held = fit_two_stage(obs, [])
    assert scales.compute == pytest.approx((2 * 1e-4 * 1e-3 + 1e-2 * 0.4) / (2 * 1e-8 + 1e-4))
    assert scales.compute > 39.9 and held == ("overhead", "memory", "bandwidth", "latency", "dispatch")


def test_collectives_alone_fit_only_communication():
    """Without trials the compute-side scales are held at 1 and named."""
    obs = [Observation(label="a", parts=Parts(compute_s=0.0, bandwidth_s=1e-4, latency_s=1e-4), measured_s=6e-4),
           Observation(label="b", parts=Parts(compute_s=0.0, bandwidth_s=1e-3, latency_s=1e-4), measured_s=2.4e-3)]
    scales, held = fit_scales(obs)
    assert held == ("compute", "overhead", "memory", "dispatch")
    assert scales.bandwidth == pytest.approx(2.0) and scales.latency == pytest.approx(4.0)


def test_one_trial_cannot_split_compute_from_overhead():
    """One trial constrains one sum: the overhead is held, the compute scale takes the whole difference."""
    obs = [Observation(label="t", parts=Parts(compute_s=0.1, overhead_s=0.01), measured_s=0.33)]
    scales, held = fit_scales(obs)
    assert "overhead" in held and scales.overhead == 1.0
    assert scales.compute * 0.1 + 0.01 == pytest.approx(0.33)


def test_nothing_measured_and_negative_speed_are_refused():
    with pytest.raises(PlanError, match="nothing was measured"):
        fit_scales([])
    # A measurement below the part no scale touches can only be met by a negative compute time.
    obs = [Observation(label="t", parts=Parts(compute_s=0.1, fixed_s=0.5), measured_s=0.2)]
    with pytest.raises(PlanError, match=r"compile\.num_steps"):
        fit_scales(obs)


def test_latency_factor_reaches_the_step_time(layouts):
    """The calibration's collective_latency_factor slows a TP layout (its per-layer all-reduces), not a DP 1 x TP 1
    layout's compute."""
    cfg, hw, ranked = layouts
    tp2 = next(r for r in ranked if r.sizes.mesh.tensor_parallel == 2)
    slow = dataclasses.replace(DEFAULT_CALIBRATION, collective_latency_factor=10.0)
    base = predict(cfg, tp2.sizes, hardware=hw, calibration=DEFAULT_CALIBRATION)
    slowed = predict(cfg, tp2.sizes, hardware=hw, calibration=slow)
    assert slowed.breakdown_s["tp_comm"] > base.breakdown_s["tp_comm"]
    assert slowed.breakdown_s["compute"] == base.breakdown_s["compute"]


def test_a_node_unlike_the_platform_is_one_line_with_the_fix():
    assert node_mismatch(hardware="p5", workers_per_node=8, memory_gib=80, found_workers=8,
                         found_memory_gib=79.2) is None
    problem = node_mismatch(hardware="p5", workers_per_node=8, memory_gib=80, found_workers=4, found_memory_gib=40)
    assert problem is not None and "\n" not in problem
    assert "4 devices of 40 GiB" in problem and "states 8 of 80 GiB" in problem
    assert "--platform-file (workers_per_node: 4, memory_per_worker_gib: 40)" in problem
    assert node_mismatch(hardware="p5", workers_per_node=8, memory_gib=80, found_workers=8,
                         found_memory_gib=40) is not None


def test_a_part_too_small_to_see_is_held_not_fitted_negative():
    """Two trials whose times grow with the GEMM count, not their size: compute alone would come out negative, so
    it is held at 1 and the fixed cost explains them."""
    obs = [Observation(label="a", parts=Parts(compute_s=0.02, overhead_s=0.002), measured_s=0.1),
           Observation(label="b", parts=Parts(compute_s=0.04, overhead_s=0.003), measured_s=0.1)]
    # By hand, fitting both: 0.02 a + 0.002 u = 0.1 and 0.04 a + 0.003 u = 0.1 give u = 100 and a = -5.
    scales, held = fit_scales(obs)
    assert held == ("compute", "memory", "bandwidth", "latency", "dispatch")
    assert scales.compute == 1.0 and scales.overhead > 0



def test_a_trial_is_timed_by_the_median_of_its_steps():
    # Two steps slowed by other work on the node (0.9 s, 0.55 s) do not move the trial's time.
    assert trial_time([0.31, 0.30, 0.9, 0.32, 0.55]) == 0.32
    assert trial_time([0.12, 0.14]) == pytest.approx(0.13)
    with pytest.raises(PlanError, match=r"--set compile.num_steps=12"):
        trial_time([])


def test_other_work_on_the_node_is_measured_and_warned_about():
    # 2 cores for 10 s: the workers used 12 CPU seconds of the 19 the node was busy, so others took 7 of 20.
    assert other_work_share(busy_s=19.0, own_s=12.0, wall_s=10.0, cores=2) == pytest.approx(0.35)
    assert other_work_share(busy_s=11.9, own_s=12.0, wall_s=10.0, cores=2) == 0.0  # counters read apart
    assert disturbance_line(["a", "b"], [0.02, 0.10]) is None  # at the threshold: quiet enough
    assert disturbance_line(["a"], [None]) is None  # no /proc/stat: nothing to say
    line = disturbance_line(["TP 1 x PP 1 x DP 2", "TP 1 x PP 2 x DP 1"], [0.62, None])
    assert line is not None and "up to 62% of a node's CPU" in line and "TP 1 x PP 1 x DP 2 62%" in line
    assert "re-run tune on idle nodes" in line and "\n" not in line


def test_the_operator_chain_gives_dispatch_and_without_it_the_trials_do(layouts):
    """Operators timed 6x the built-in 15 us give dispatch 6 by themselves; the products and trials give the rest.
    Without the chain, the trials (with the products' curve fixed) recover the same six scales."""
    cfg, hw, ranked = layouts
    truth = Scales(compute=40.0, overhead=300.0, memory=9.0, bandwidth=2.0, latency=5.0, dispatch=6.0)
    gemms = [Observation(label=f"{f:g}", parts=(p := gemm_parts(f, peak_flops=1e12, base=DEFAULT_CALIBRATION)),
                         measured_s=p.at(truth)) for f in (1e6, 1e8, 1e10)]
    trials = [Observation(label=r.label, parts=(p := parts_of(_predictor(cfg, hw, r), DEFAULT_CALIBRATION)),
                          measured_s=p.at(truth)) for r in ranked]
    sample = CollectiveSample(op="all_reduce", ranks=2, nbytes=1 << 20, seconds=0.0)
    bench = [Observation(label="ar", parts=(p := collective_parts(sample, hardware=hw, base=DEFAULT_CALIBRATION,
                                                                  workers_per_node=2)), measured_s=p.at(truth))]
    ops = [Observation(label="operator", parts=op_parts(1, op_overhead_s=15e-6), measured_s=90e-6)]  # by hand 6x
    assert fit_dispatch(ops) == pytest.approx(6.0)
    for chain in (ops, []):
        scales, held = fit_two_stage(gemms, trials + bench, chain)
        assert held == ()
        for got, want in zip(scales.vector(), truth.vector()):
            assert got == pytest.approx(want, rel=1e-6)
    fit = refit(DEFAULT_CALIBRATION, trials + bench, source="t", gemms=gemms, ops=ops)
    assert fit.calibration.op_overhead_factor == pytest.approx(6.0) and fit.observations == 8
    assert fit.calibration.op_overhead_s("gloo") == pytest.approx(90e-6) and fit.calibration.op_overhead_s("xla") == 0
    # One stage: the chain's dispatch is kept, the trials fit the rest around it.
    one, _ = fit_scales(trials + bench, ops)
    assert one.dispatch == pytest.approx(6.0)
