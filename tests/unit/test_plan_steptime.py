"""The step-time model (plan/steptime.py) term by term against hand computation, the planner's choice by predicted
time (plan/layout_choice.py), and the published comparison of benchmarks/steptime_published.py (issue 29)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_hpc.cli.main import main
from megatron_hpc.config.hardware import Hardware, Link
from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform, with_hardware
from megatron_hpc.plan import layout_choice
from megatron_hpc.plan.calibration import Calibration
from megatron_hpc.plan.memory import rank_parameters
from megatron_hpc.plan.model_math import flops_per_token
from megatron_hpc.plan.op_counts import layer_ops
from megatron_hpc.plan.planner import make_plan
from megatron_hpc.plan.steptime import TERMS, Layout, predict_step_time

REPO = Path(__file__).resolve().parents[2]
H, LAYERS, SEQ, HEADS, VOCAB = 1024, 4, 512, 16, 4096
PEAK, HBM, INTRA, INTER = 100e12, 1000e9, 100e9, 40e9
HW = Hardware(name="round", runtime="p5", workers_per_node=8, memory_per_worker_gib=80.0,
              memory_bandwidth_gbytes_per_s=HBM / 1e9, peak_tflops_16bit=PEAK / 1e12, peak_tflops_fp32=PEAK / 1e12,
              intra_node=Link(bandwidth_gbytes_per_s=INTRA / 1e9, latency_us=1.0),
              inter_node=Link(bandwidth_gbytes_per_s=INTER / 1e9, latency_us=1.0))
# Every share 1, no fixed GEMM or operator cost and no element-wise traffic: each term is its bytes or FLOPs over the
# figure.
EXACT = Calibration(gemm_peak_fraction=1.0, gemm_overhead_s=0.0, collective_bandwidth_fraction=1.0,
                    memory_bandwidth_fraction=1.0, elementwise_bytes_per_saved_byte=0.0, op_overhead_factor=0.0)


def cfg(*sets: str):
    return load_recipe("tiny", [f"model.hidden_size={H}", f"model.num_layers={LAYERS}", f"model.seq_length={SEQ}",
                                f"model.max_position_embeddings={SEQ}", f"model.num_attention_heads={HEADS}",
                                f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=1",
                                "train.precision=bf16", "train.micro_batch_size=1", "train.global_batch_size=8",
                                "parallel.overlap_grad_reduce=false", *sets])


def layout(t=1, p=1, d=1, m=8, v=1) -> Layout:
    return Layout(tensor_parallel=t, pipeline_parallel=p, data_parallel=d, num_micro_batches=m,
                  stage_layers=(LAYERS // (p * v),) * (p * v), workers_per_node=8, padded_vocab=VOCAB)


def predict(c, lay: Layout, cal: Calibration = EXACT):
    return predict_step_time(c, lay, hardware=HW, calibration=cal,
                             flops_per_token=flops_per_token(c.model, padded_vocab=VOCAB))


def test_compute_is_the_plans_flops_at_peak_plus_the_loss_traffic():
    c = cfg()
    time = predict(c, layout())
    tokens = 8 * SEQ
    logits = 4.0 * SEQ * VOCAB * 4 * 8 / HBM  # fp32 logits, softmax and their gradient, per micro-batch
    want = flops_per_token(c.model, padded_vocab=VOCAB) * tokens / PEAK + logits
    assert time.breakdown_s["compute"] == pytest.approx(want, rel=1e-9)
    assert time.step_time_s == pytest.approx(sum(time.breakdown_s.values()))
    assert list(time.breakdown_s) == list(TERMS)


def test_tp_all_reduces_per_layer_with_and_without_sequence_parallelism():
    tokens_bytes = SEQ * H * 2  # one micro-batch's activations in bf16
    ring = 2 * (2 - 1) * (1e-6 + tokens_bytes / 2 / INTRA)  # all-reduce over 2 ranks: 2 steps of half the bytes
    per_micro = LAYERS * 4 * ring + ring  # 2 forward + 2 backward a layer, and the output layer's input
    assert predict(cfg(), layout(t=2)).breakdown_s["tp_comm"] == pytest.approx(8 * per_micro, rel=1e-9)
    assert predict(cfg("parallel.sequence_parallel=true"), layout(t=2)).breakdown_s["tp_comm"] == \
        pytest.approx(8 * per_micro, rel=1e-9)  # all-gather + reduce-scatter move what the all-reduce moves
    # ... but sequence parallelism splits the norms' and dropouts' memory-bound work over TP
    streamed = dataclasses.replace(EXACT, elementwise_bytes_per_saved_byte=2.0)
    assert predict(cfg("parallel.sequence_parallel=true"), layout(t=2), streamed).breakdown_s["compute"] < \
        predict(cfg(), layout(t=2), streamed).breakdown_s["compute"]
    full = predict(cfg("model.recompute=true"), layout(t=2)).breakdown_s["tp_comm"]
    assert full == pytest.approx(8 * (LAYERS * 6 * ring + ring), rel=1e-9)  # the recomputed forward's two


def test_recompute_adds_the_forward_or_the_attention_core():
    layer_forward_flops = SEQ * (24 * H * H + 4 * SEQ * H)  # QKV, projection, MLP and the core, one micro-batch
    full = predict(cfg("model.recompute=true"), layout()).breakdown_s["recompute"]
    assert full == pytest.approx(8 * LAYERS * layer_forward_flops / PEAK, rel=1e-9)
    selective = predict(cfg("model.recompute_granularity=selective"), layout()).breakdown_s["recompute"]
    assert selective == pytest.approx(8 * LAYERS * 4 * SEQ * SEQ * H / PEAK, rel=1e-9)
    assert predict(cfg(), layout()).breakdown_s["recompute"] == 0.0


def test_bubble_is_p_minus_1_micro_batch_times_over_v_and_pp_sends_cross_nodes_when_a_stage_fills_one():
    no_p2p = dataclasses.replace(EXACT, pp_comm_overlap=1.0)
    whole = predict(cfg(), layout(p=1), no_p2p).breakdown_s["compute"] / 8  # one micro-batch through every layer
    plain, interleaved = predict(cfg(), layout(p=2), no_p2p), predict(cfg(), layout(p=2, v=2), no_p2p)
    # (p - 1) / v micro-batch times of the average rank, which runs 1/p of the model
    assert plain.breakdown_s["pipeline_bubble"] == pytest.approx(1 * whole / 2, rel=1e-9)
    assert interleaved.breakdown_s["pipeline_bubble"] == pytest.approx(whole / 2 / 2, rel=1e-9)
    send = SEQ * H * 2
    inside = predict(cfg(), layout(p=4, t=1, d=2)).breakdown_s["pp_comm"]  # TP x DP = 2 < 8 per node
    across = predict(cfg(), layout(p=4, t=8, d=1)).breakdown_s["pp_comm"]  # a stage fills the node
    assert inside == pytest.approx(8 * 2 * (1e-6 + send / INTRA), rel=1e-9)
    assert across == pytest.approx(8 * 2 * (1e-6 + send / (INTER / 8)), rel=1e-9)  # a NIC share per worker
    # Sequence parallelism hands each stage's (B, S/t, H) shard on: 1/t of the bytes, the same latency.
    sharded = predict(cfg("parallel.sequence_parallel=true"), layout(p=4, t=8, d=1)).breakdown_s["pp_comm"]
    assert sharded == pytest.approx(8 * 2 * (1e-6 + send / 8 / (INTER / 8)), rel=1e-9)


def test_dp_reduce_and_the_distributed_optimizer():
    c = cfg()
    params = rank_parameters(c.model, padded_vocab=VOCAB, tensor_parallel=1, layers=LAYERS, first=True, last=True)
    grad_bytes = params * 4  # autocast keeps fp32 grads
    d = 4
    ring = 2 * (d - 1) * (1e-6 + grad_bytes / d / INTRA)
    plain = predict(c, layout(d=d, m=2))
    assert plain.breakdown_s["dp_comm"] == pytest.approx(ring, rel=1e-9)
    assert plain.breakdown_s["optimizer"] == pytest.approx(params * 36 / HBM, rel=1e-9)
    sharded = predict(cfg("parallel.distributed_optimizer=true"), layout(d=d, m=2))
    assert sharded.breakdown_s["dp_comm"] == pytest.approx(ring, rel=1e-9)  # reduce-scatter + all-gather
    assert sharded.breakdown_s["optimizer"] == pytest.approx(plain.breakdown_s["optimizer"] / d, rel=1e-9)
    overlapped = predict(cfg("parallel.overlap_grad_reduce=true"), layout(d=d, m=2)).breakdown_s["dp_comm"]
    assert 0 < overlapped < ring  # hidden behind the last micro-batch's backward, but for its last bucket


def test_gemm_fraction_saturates_and_halves_at_the_fixed_cost():
    cal = Calibration()
    assert cal.gemm_fraction(PEAK * cal.gemm_overhead_s, PEAK) == pytest.approx(cal.gemm_peak_fraction / 2)
    assert cal.gemm_fraction(PEAK * 1.0, PEAK) == pytest.approx(cal.gemm_peak_fraction, rel=1e-4)


def slow_tp(hw: Hardware) -> Hardware:
    return dataclasses.replace(hw, intra_node=dataclasses.replace(hw.intra_node, bandwidth_gbytes_per_s=5.0))


def test_dispatch_is_each_micro_batchs_operators_at_their_fixed_cost():
    """By hand: 8 micro-batches x 4 layers x the layer's operators (plan/op_counts.py: 34 forward + 71 backward for
    this GPT) x 1 us (CUDA's built-in, op_overhead_factor 1); full recomputation runs each forward's again; the
    pipeline bubble carries the dispatch of the micro-batches it waits for."""
    cal = dataclasses.replace(EXACT, op_overhead_factor=1.0)
    ops = layer_ops(cfg().model)
    assert (ops.forward, ops.backward) == (34, 71)
    assert predict(cfg(), layout(), cal).breakdown_s["dispatch"] == pytest.approx(8 * LAYERS * 105 * 1e-6)
    full = predict(cfg("model.recompute=true"), layout(), cal).breakdown_s["dispatch"]
    assert full == pytest.approx(8 * LAYERS * (105 + 34) * 1e-6)
    tp2 = predict(cfg(), layout(t=2), cal)
    assert tp2.breakdown_s["dispatch"] == pytest.approx(8 * LAYERS * 105 * 1e-6)  # TP: as many operators, smaller
    bubble = predict(cfg(), layout(p=2), cal).breakdown_s["pipeline_bubble"] - predict(
        cfg(), layout(p=2)).breakdown_s["pipeline_bubble"]
    assert bubble == pytest.approx(LAYERS / 2 * 105 * 1e-6)  # (p - 1) micro-batches through half the layers
    assert predict(cfg(), layout(), EXACT).breakdown_s["dispatch"] == 0.0


def test_costlier_operators_move_the_choice_to_fewer_micro_batches_per_rank():
    """gpt3_39.1b on 64 p5 nodes: TP 2 by default; with each operator 1000x dearer, TP 1 (TP halves DP, which
    doubles the micro-batches each rank runs through the same layers: twice the operators)."""
    c = load_recipe("gpt3_39.1b", ["data.source=synthetic"])
    p5 = get_platform("p5")
    default = make_plan(c, num_nodes=64, platform=p5)
    costly = make_plan(c, num_nodes=64, platform=p5, calibration=Calibration(op_overhead_factor=1000.0))
    assert (default.tensor_parallel, costly.tensor_parallel) == (2, 1)
    # TP 1 at 1000x runs half the operators a rank of TP 2 runs
    assert costly.step_time_breakdown_s["dispatch"] == pytest.approx(
        1000 * default.step_time_breakdown_s["dispatch"] / 2, rel=1e-3)


def test_the_choice_follows_the_prediction_and_changes_when_a_term_gets_costlier():
    c = load_recipe("gpt3_18.4b", ["data.source=synthetic"])
    p5 = get_platform("p5")
    fast = make_plan(c, num_nodes=16, platform=p5)
    assert fast.predicted_step_time_s <= min(a["predicted_step_time_s"] for a in fast.layout_alternatives)
    rule = make_plan(load_recipe("gpt3_18.4b", ["data.source=synthetic", "parallel.choose_layout=fits"]),
                     num_nodes=16, platform=p5)
    assert (rule.tensor_parallel, rule.pipeline_parallel) == (8, 1)  # the table's layout, by the memory rule
    assert rule.predicted_step_time_s > fast.predicted_step_time_s
    assert "--set parallel.choose_layout=fastest picks it" in rule.layout_choice
    # TP's collectives 90x dearer: the choice moves to less TP
    costly = make_plan(c, num_nodes=16, platform=with_hardware(slow_tp(p5.hardware)))
    assert costly.tensor_parallel < fast.tensor_parallel or fast.tensor_parallel == 1
    wide = make_plan(load_recipe("gpt3_18.4b", ["data.source=synthetic", "parallel.tensor=8"]), num_nodes=16,
                     platform=with_hardware(slow_tp(p5.hardware)))
    assert wide.tensor_parallel == 8 and "parallel.tensor=8 pinned" in wide.layout_choice  # a pin stays


def test_every_valid_layout_is_evaluated_once(monkeypatch):
    calls = []
    real = layout_choice.predict_step_time
    monkeypatch.setattr(layout_choice, "predict_step_time", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    c = load_recipe("gpt3_175b", ["data.source=synthetic", "parallel.tensor=0", "parallel.pipeline=0"])
    plan = make_plan(c, num_nodes=512, platform=get_platform("p5"))
    fitting = layout_choice.fitting_layouts(c, get_platform("p5"), num_nodes=512, per_node=8)
    assert len(calls) == len(fitting) == len({(x.tensor_parallel, x.pipeline_parallel) for x in calls}) >= 5
    assert len(plan.layout_alternatives) == min(layout_choice.ALTERNATIVES_KEPT, len(fitting) - 1)


def test_plan_prints_the_prediction_explains_and_json_has_the_keys(capsys):
    args = ["plan", "--recipe", "gpt3_39.1b", "--nodes", "16", "--platform", "p5", "--set", "data.source=synthetic"]
    assert main([*args, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "calibration: built-in defaults (no measurement)" in out and "MFU" in out
    assert "next best layouts (chosen: TP" in out and "limited by" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["step_time_breakdown_s"]) == set(TERMS)
    assert data["predicted_tokens_per_s"] == pytest.approx(1024 * 2048 / data["predicted_step_time_s"], rel=1e-3)
    assert 0 < data["predicted_mfu"] < 1 and data["layout_choice"]


def test_predictions_against_published_runs(monkeypatch):
    spec = importlib.util.spec_from_file_location("steptime_published", REPO / "benchmarks" / "steptime_published.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    results = {r.row.name: r for r in bench.results()}
    for r in results.values():
        if r.row.tflops_per_gpu:  # the A100 rows: within the 20% (benchmarks/RESULTS.md)
            assert abs(r.error) <= bench.TOLERANCE, (r.row.name, r.predicted, r.published)
    # The H100 rows at the README's layouts: within 20% but two, pinned with their reasons (RESULTS.md): at 96
    # GPUs the model is optimistic for every virtual stage count (an A100-era GEMM share on H100); 32B's TP
    # communication, a quarter of our step, is what the published run's --tp-comm-overlap hides.
    outside = {"177B, 96 H100", "32B, 384 H100"}
    for name, r in results.items():
        if not r.row.tflops_per_gpu and name not in outside:
            assert abs(r.error) <= bench.TOLERANCE, (name, r.predicted, r.published)
    assert results["177B, 96 H100"].spread[0] > 0.1 and results["177B, 96 H100"].error > bench.TOLERANCE
    assert results["32B, 384 H100"].error < -bench.TOLERANCE and results["32B, 384 H100"].tp_share > 0.2
    assert len([r for r in results.values() if not r.row.tflops_per_gpu]) == 11
