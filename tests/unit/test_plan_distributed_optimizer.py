"""parallel.distributed_optimizer in the planner and the shard layout: what each DP rank owns, the memory it saves,
and the refusals and warnings before anything is queued."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.errors import PlanError
from megatron_hpc.plan.jobs import phase_env
from megatron_hpc.plan.memory import GIB, SHARD_ALIGN, estimate_memory
from megatron_hpc.plan.planner import Plan, distributed_optimizer_warning, make_plan
from megatron_hpc.plan.spec import RunSpec, plan_run
from megatron_hpc.train.distributed_optimizer import shard_layout


@pytest.mark.parametrize("bucket", [None, 800])
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_shards_cover_every_element_once_and_equally(dp, bucket):
    sizes = [700, 3, 129, 1000, 1]
    order = [4, 3, 2, 1, 0]  # backward order: the last parameters first
    layouts = [shard_layout(sizes, dp_size=dp, dp_rank=r, order=order, bucket_elements=bucket) for r in range(dp)]
    buckets = layouts[0].buckets
    # 800-element buckets close before a parameter that would overflow them: 1 | 1000 (alone, too big) | 129 + 3 | 700
    expected = [(4, 3, 2, 1, 0)] if bucket is None else [(4,), (3,), (2, 1), (0,)]
    assert [b.members for b in buckets] == expected
    for b in buckets:
        assert b.padded % (dp * SHARD_ALIGN) == 0 and b.padded >= sum(sizes[i] for i in b.members)
    owned: dict[int, list[tuple[int, int]]] = {}
    for lay in layouts:
        slices = [lay.slice_of(b) for b in buckets]
        assert [hi - lo for lo, hi in slices] == [b.padded // dp for b in buckets]
        for piece in lay.pieces:
            # inside one of this rank's slices, at the parameter's own place in the flat buffer
            assert any(lo <= piece.offset and piece.offset + piece.end - piece.start <= hi for lo, hi in slices)
            assert piece.offset == lay.starts[piece.index] + piece.start
            owned.setdefault(piece.index, []).append((piece.start, piece.end))
    for index, size in enumerate(sizes):
        ranges = sorted(owned[index])
        # contiguous, no gap and no overlap, from 0 to the parameter's size
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_piece_offsets_follow_the_flat_order():
    lay = shard_layout([300, 200], dp_size=2, dp_rank=1)  # 500 padded to 512: rank 1 owns [256, 512)
    assert lay.slice_of(lay.buckets[0]) == (256, 512)
    assert [(p.index, p.start, p.end, p.offset) for p in lay.pieces] == [(0, 256, 300, 256), (1, 0, 200, 300)]


@pytest.mark.parametrize("precision,backend,adam", [("fp32", "cuda", 8), ("bf16", "cuda", 8)])
@pytest.mark.parametrize("dp", [2, 4])
def test_only_the_optimizer_state_is_divided_by_dp(precision, backend, adam, dp):
    m = load_recipe("gpt3_1.7b").model
    args = dict(padded_vocab=51200, tensor_parallel=2, micro_batch=1, precision=precision, backend=backend)
    plain, sharded = estimate_memory(m, **args), estimate_memory(m, **args, optimizer_shards=dp)
    params_per_rank = plain.weights_and_optimizer_gib * GIB / (18 if precision == "bf16" else 16)
    saved = plain.weights_and_optimizer_gib - sharded.weights_and_optimizer_gib
    assert saved * GIB == pytest.approx(params_per_rank * adam * (1 - 1 / dp))
    assert sharded.activations_gib == plain.activations_gib and sharded.logits_gib == plain.logits_gib


@pytest.mark.parametrize("precision,model_bytes", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_fp32_masters_on_xla_count_model_weights_and_grads_whole_and_master_and_adam_over_dp(precision, model_bytes,
                                                                                            dp):
    m = load_recipe("gpt3_1.7b").model
    args = dict(padded_vocab=51200, tensor_parallel=2, micro_batch=1, precision=precision)
    reference = estimate_memory(m, padded_vocab=51200, tensor_parallel=2, micro_batch=1, precision="fp32",
                                backend="cuda")
    params_per_rank = reference.weights_and_optimizer_gib * GIB / 16  # fp32 off XLA: 16 bytes a parameter
    masters = estimate_memory(m, **args, backend="xla", optimizer_shards=dp, fp32_master=True)
    assert masters.weights_and_optimizer_gib * GIB == pytest.approx(
        params_per_rank * (2 * model_bytes + 12 / dp), rel=1e-6)


def test_plan_records_it_and_sizes_with_it():
    over = ["parallel.tensor=1", "parallel.pipeline=1"]
    plain = make_plan(load_recipe("gpt3_1.7b", over), num_nodes=2, platform=get_platform("p5"))
    sharded = make_plan(load_recipe("gpt3_1.7b", [*over, "parallel.distributed_optimizer=true"]), num_nodes=2,
                        platform=get_platform("p5"))
    assert (plain.distributed_optimizer, sharded.distributed_optimizer) == (False, True)
    assert sharded.data_parallel == 16
    fp32_adam = plain.num_parameters * 8 * (1 - 1 / 16) / GIB
    assert plain.memory_per_worker_gib - sharded.memory_per_worker_gib == pytest.approx(fp32_adam, abs=2e-3)


def test_tp1_that_only_fits_sharded_is_advised():
    # gpt3_6.7b at TP 1 with full recompute: about 100 GiB plain, under 72 with Adam over 16 ranks.
    cfg = load_recipe("gpt3_6.7b", ["parallel.tensor=1", "parallel.pipeline=1", "model.recompute=true"])
    with pytest.raises(PlanError, match=r"--set parallel.distributed_optimizer=true"):
        make_plan(cfg, num_nodes=2, platform=get_platform("p5"))


def test_planned_on_trn1_with_bf16_weights_and_fp32_masters():
    """No longer refused on XLA (torch_xla's ZeRO-1, train/xla_zero.py): the estimate counts bf16 weights and grads
    (2 + 2) and an fp32 master with fp32 Adam moments split over DP (12/d) instead of pure bf16's 8 bytes."""
    over = ["parallel.tensor=8", "parallel.pipeline=1"]
    plain = make_plan(load_recipe("gpt3_6.7b", over), num_nodes=16, platform=get_platform("trn1"))
    sharded = make_plan(load_recipe("gpt3_6.7b", [*over, "parallel.distributed_optimizer=true"]), num_nodes=16,
                        platform=get_platform("trn1"))
    assert sharded.distributed_optimizer
    dp = sharded.data_parallel
    assert dp == plain.data_parallel and dp > 3
    per_rank = plain.memory_breakdown_gib["weights"] * GIB / 2  # pure bf16: 2 bytes of weight a parameter
    saved = (plain.memory_breakdown_gib["weights"] + plain.memory_breakdown_gib["grads"]
             + plain.memory_breakdown_gib["optimizer"]) - (sharded.memory_breakdown_gib["weights"]
                                                            + sharded.memory_breakdown_gib["grads"]
                                                            + sharded.memory_breakdown_gib["optimizer"])
    assert saved * GIB == pytest.approx(per_rank * (8 - (4 + 12 / dp)), rel=5e-3)


def test_fp32_masters_keep_xla_use_bf16_out_of_the_job_environment():
    trn1 = get_platform("trn1")
    pure = load_recipe("gpt3_6.7b", ["train.precision=bf16"])
    masters = load_recipe("gpt3_6.7b", ["train.precision=bf16", "parallel.distributed_optimizer=true"])
    assert phase_env(pure, trn1, extra={}).get("XLA_USE_BF16") == "1"
    assert "XLA_USE_BF16" not in phase_env(masters, trn1, extra={})


@pytest.mark.parametrize("platform,sharded,masters", [("trn1", True, True), ("trn1", False, False),
                                                      ("p5", True, False), ("cpu", True, False)])
def test_the_plan_says_once_whether_fp32_masters_are_kept(platform, sharded, masters):
    """The distributed optimizer on XLA keeps them (torch_xla's ZeRO-1); the trainer reads the plan's field."""
    over = ["data.source=synthetic", f"parallel.distributed_optimizer={str(sharded).lower()}"]
    plan = make_plan(load_recipe("tiny" if platform == "cpu" else "gpt3_6.7b", over), num_nodes=1 if platform == "cpu"
                     else 16, platform=get_platform(platform))
    assert plan.fp32_master is masters


def test_plan_json_shows_the_fp32_masters(capsys):
    args = ["plan", "--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "trn1", "--json", "--set",
            "data.source=synthetic"]
    assert main([*args, "--set", "parallel.distributed_optimizer=true"]) == 0
    assert json.loads(capsys.readouterr().out)["fp32_master"] is True
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["fp32_master"] is False


def test_a_plan_json_without_fp32_master_or_contradicting_it_is_refused_with_the_fix():
    """A run folder planned before the field existed: the trainer refuses it (one line, the field named), and
    `submit --resume` re-plans it from its config.json, as for any stale plan.json."""
    cfg = load_recipe("gpt3_6.7b", ["data.source=synthetic", "parallel.distributed_optimizer=true"])
    spec = plan_run(cfg, num_nodes=16, platform=get_platform("trn1"))
    old = {k: v for k, v in spec.plan.to_json().items() if k != "fp32_master"}
    with pytest.raises(PlanError, match=r"\(missing fp32_master\).*`megatron-hpc submit --resume RUN`"):
        RunSpec.from_json(spec.config_json(), old, where="run")
    assert RunSpec.from_json(spec.config_json(), spec.plan.to_json(), where="run").plan.fp32_master is True
    with pytest.raises(PlanError, match=r"fp32_master False is not that of backend xla with distributed_optimizer "
                                        r"True.*submit --resume"):
        Plan.from_json({**spec.plan.to_json(), "fp32_master": False})


def test_fp16_with_it_on_xla_is_refused_with_the_fix():
    cfg = load_recipe("gpt3_6.7b", ["parallel.distributed_optimizer=true", "train.precision=fp16"])
    with pytest.raises(PlanError, match=r"--set train.precision=bf16"):
        make_plan(cfg, num_nodes=16, platform=get_platform("trn1"))


def test_dp_1_works_and_says_it_is_pointless():
    plan = make_plan(load_recipe("tiny", ["parallel.distributed_optimizer=true"]), num_nodes=1,
                     platform=get_platform("cpu"))
    assert plan.data_parallel == 1
    assert "DP 1 shards nothing" in distributed_optimizer_warning(plan)
    two = make_plan(load_recipe("tiny", ["parallel.distributed_optimizer=true", "launch.workers_per_node=2"]),
                    num_nodes=1, platform=get_platform("cpu"))
    assert two.data_parallel == 2 and distributed_optimizer_warning(two) is None


def test_plan_json_carries_the_flag_and_the_warning(cli_in_process):
    out = cli_in_process("plan", "--recipe", "tiny", "--json", "--set", "parallel.distributed_optimizer=true")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["distributed_optimizer"] is True
    assert any("shards nothing" in w for w in data["warnings"])


def test_misspelt_key_suggests_the_right_one(cli_in_process):
    out = cli_in_process("plan", "--recipe", "tiny", "--set", "parallel.use_distributed_optimizer=true")
    assert out.returncode != 0 and "parallel.distributed_optimizer" in out.stderr
    assert dataclasses.is_dataclass(load_recipe("tiny").parallel)


def test_overlap_param_gather_without_the_distributed_optimizer_is_refused_with_the_fix():
    cfg = load_recipe("tiny", ["parallel.overlap_param_gather=true", "launch.workers_per_node=2"])
    with pytest.raises(PlanError, match=r"--set parallel.distributed_optimizer=true") as err:
        make_plan(cfg, num_nodes=1, platform=get_platform("cpu"))
    assert "\n" not in str(err.value)
    on = make_plan(load_recipe("tiny", ["parallel.overlap_param_gather=true", "parallel.distributed_optimizer=true",
                                        "launch.workers_per_node=2"]), num_nodes=1, platform=get_platform("cpu"))
    assert on.data_parallel == 2


@pytest.mark.parametrize("pipeline", ["2", "0"])
def test_overlap_param_gather_under_pipelining_is_refused_with_the_fix(pipeline):
    # "0": the planner chooses pipelining for gpt3_6.7b on 2 p5 nodes at TP 1, so the check after sizing refuses it.
    over = ["parallel.tensor=1", f"parallel.pipeline={pipeline}", "parallel.distributed_optimizer=true"]
    assert make_plan(load_recipe("gpt3_6.7b", over), num_nodes=2, platform=get_platform("p5")).pipeline_parallel > 1
    # PP 1 does not fit at TP 1 without recomputation (that is why the planner pipelines), so the refusal names only
    # the fix that plans; the fixes it names are planned before they are printed (plan/fixes.py).
    with pytest.raises(PlanError) as info:
        make_plan(load_recipe("gpt3_6.7b", [*over, "parallel.overlap_param_gather=true"]), num_nodes=2,
                  platform=get_platform("p5"))
    assert str(info.value).endswith("; --set parallel.overlap_param_gather=false")
    # With full recomputation PP 1 fits at TP 1, and both fixes are named.
    pinned = [*over, "model.recompute=true"] if pipeline == "2" else None
    if pinned:
        assert make_plan(load_recipe("gpt3_6.7b", [*pinned, "parallel.pipeline=1"]), num_nodes=2,
                         platform=get_platform("p5")).pipeline_parallel == 1
        with pytest.raises(PlanError, match=r"--set parallel.overlap_param_gather=false or parallel.pipeline=1"):
            make_plan(load_recipe("gpt3_6.7b", [*pinned, "parallel.overlap_param_gather=true"]), num_nodes=2,
                      platform=get_platform("p5"))
