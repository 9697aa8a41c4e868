"""Pipeline parallelism in the planner: TP x PP x DP for the size-table recipes, the per-stage memory estimate, the
bubble, the refusals, and what `plan` / `submit` say about a pipeline."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import PLATFORMS, get_platform
from megatron_hpc.errors import ConfigError, PlanError
from megatron_hpc.plan.memory import GIB, PipelineShape, estimate_memory, estimate_ranks, in_flight
from megatron_hpc.plan.model_math import num_parameters
from megatron_hpc.plan.planner import Plan, check_pipeline_runtime, idle_workers_warning, make_plan
from megatron_hpc.plan.sizing import USABLE_MEMORY_FRACTION


def plan(recipe, nodes, platform=None, overrides=()):
    """The memory rule's plan (parallel.choose_layout=fits): these tests are about stages, memory and the table's
    sizes, which the rule reproduces; the choice by predicted time is tests/unit/test_plan_steptime.py's."""
    cfg = load_recipe(recipe, ["parallel.choose_layout=fits", *overrides])
    return make_plan(cfg, num_nodes=nodes, platform=get_platform(platform or cfg.launch.platform))


# Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters"), table 1: TP, PP.
TABLE = {"gpt3_1.7b": (1, 1), "gpt3_3.6b": (2, 1), "gpt3_7.5b": (4, 1), "gpt3_18.4b": (8, 1), "gpt3_39.1b": (8, 2),
         "gpt3_76.1b": (8, 4), "gpt3_145.6b": (8, 8), "gpt3_310.1b": (8, 16)}
FLOORS = {**TABLE, "gpt3_6.7b": (1, 1)}  # 6.7B is not in the table (the Neuron reference runs it at TP 8)
HEADS = {"gpt3_1.7b": 24, "gpt3_3.6b": 32, "gpt3_7.5b": 32, "gpt3_6.7b": 32, "gpt3_18.4b": 48, "gpt3_39.1b": 64,
         "gpt3_76.1b": 80, "gpt3_145.6b": 96, "gpt3_310.1b": 128}

# With one micro-batch of 1 per pipeline stage, DP x PP <= global batch (1024) and TP x PP x DP = workers, so
# TP >= workers / 1024: 16 on 512 trn1 nodes (16384 workers), 32 on 512 trn2 nodes (32768). Where the heads allow no
# TP that wide inside a node (24 heads: at most 8; 48 and 80 heads: at most 16 on trn2), no mesh uses every worker.
# The planner keeps the recipe's batch and takes fewer workers per node: 1024 x the widest TP / 512 nodes; the batch
# that would occupy them all is workers / the widest TP.
IDLE = {("gpt3_1.7b", "trn1", 512): (8 * 1024 // 512, 16384 // 8),
        ("gpt3_1.7b", "trn2", 512): (8 * 1024 // 512, 32768 // 8),
        ("gpt3_18.4b", "trn2", 512): (16 * 1024 // 512, 32768 // 16),
        ("gpt3_76.1b", "trn2", 512): (16 * 1024 // 512, 32768 // 16)}


def _check_sizes(p: Plan, recipe: str, platform: str, nodes: int, *, per_node: int | None = None) -> None:
    tp_floor, pp_floor = FLOORS[recipe]
    limit = PLATFORMS[platform]
    per_node = per_node or limit.workers_per_node
    assert p.tensor_parallel * p.pipeline_parallel * p.data_parallel == p.world_size == nodes * per_node
    assert p.workers_per_node == per_node and per_node % p.tensor_parallel == 0  # TP inside a node
    assert p.memory_per_worker_gib <= limit.memory_per_worker_gib * USABLE_MEMORY_FRACTION
    assert p.tensor_parallel >= tp_floor
    assert p.tensor_parallel * p.pipeline_parallel >= tp_floor * pp_floor
    assert p.num_micro_batches >= p.pipeline_parallel
    if nodes < 512:
        # At 512 Trainium nodes the batch forces TP to 16 or 32 (above), and the planner then prefers wider TP
        # inside the node over more stages (a smaller bubble): TP x PP stays at least the table's, PP may not.
        assert p.pipeline_parallel >= pp_floor
    if platform == "p5" and nodes < 512:
        # 8 x 80 GB per node like the table's A100 servers: the memory estimate gives the table itself.
        assert (p.tensor_parallel, p.pipeline_parallel) == TABLE.get(recipe, (2, 1))
    Plan.from_json(json.loads(json.dumps(p.to_json())))  # consistent, and it round-trips


@pytest.mark.parametrize("nodes", [16, 64, 512])
@pytest.mark.parametrize("platform", ["trn1", "trn2", "p5"])
@pytest.mark.parametrize("recipe", sorted(FLOORS))
def test_size_table_recipes_plan_at_least_the_tables_sizes(recipe, platform, nodes):
    p = plan(recipe, nodes, platform)
    full = PLATFORMS[platform].workers_per_node
    if (recipe, platform, nodes) not in IDLE:
        assert (p.idle_workers_per_node, p.global_batch_for_all_workers, idle_workers_warning(p)) == (0, None, None)
        _check_sizes(p, recipe, platform, nodes)
        return
    per_node, batch = IDLE[recipe, platform, nodes]
    _check_sizes(p, recipe, platform, nodes, per_node=per_node)
    widest = max(t for t in PLATFORMS[platform].tp_choices if HEADS[recipe] % t == 0 and t <= per_node)
    assert p.tensor_parallel == widest and p.global_batch_size == 1024  # the recipe's batch is kept
    assert (p.idle_workers_per_node, p.global_batch_for_all_workers) == (full - per_node, batch)
    warning = idle_workers_warning(p)
    assert "\n" not in warning and warning.startswith(f"the global batch 1024 cannot occupy the {nodes * full} workers")
    assert (f"planned {per_node} of {full} workers per node: {nodes * (full - per_node)} workers idle; use --set "
            f"train.global_batch_size={batch} to use them all") in warning
    # The fix it names occupies every worker.
    fixed = plan(recipe, nodes, platform, [f"train.global_batch_size={batch}"])
    assert (fixed.idle_workers_per_node, fixed.global_batch_for_all_workers) == (0, None)
    assert fixed.tensor_parallel == widest
    _check_sizes(fixed, recipe, platform, nodes)


def test_a_batch_too_small_for_the_users_workers_per_node_is_refused_with_the_fix():
    # The user's own launch.workers_per_node is kept (no idle workers behind their back): today's refusal.
    with pytest.raises(PlanError) as info:
        plan("gpt3_1.7b", 512, "trn1", ["launch.workers_per_node=32"])
    assert "train.global_batch_size=1024 is too small for 16384 workers" in str(info.value)
    assert "use --set train.global_batch_size=2048" in str(info.value) and "\n" not in str(info.value)
    # The recipe's pinned TP x PP are kept too, on fewer workers per node (TP 8 must divide them: 16, not 8 or 24).
    pinned = plan("gpt3_1.7b", 512, "trn1", ["parallel.tensor=8", "parallel.pipeline=1"])
    assert (pinned.tensor_parallel, pinned.pipeline_parallel, pinned.workers_per_node, pinned.data_parallel) == \
        (8, 1, 16, 1024)
    assert pinned.global_batch_for_all_workers == 2048


def test_p5_reproduces_the_table_and_trainium_pipelines_deeper():
    assert [(plan(r, 64, "p5").tensor_parallel, plan(r, 64, "p5").pipeline_parallel) for r in TABLE] == \
        list(TABLE.values())
    # trn1's 16 GiB NeuronCores hold less than an 80 GB GPU: 39.1B needs PP 4 at TP 8 there, 310.1B TP 32 x PP 16.
    assert (plan("gpt3_39.1b", 16, "trn1").tensor_parallel, plan("gpt3_39.1b", 16, "trn1").pipeline_parallel) == (8, 4)
    big = plan("gpt3_310.1b", 16, "trn1")
    assert (big.tensor_parallel, big.pipeline_parallel, big.data_parallel) == (32, 16, 1)


def test_pinned_sizes_are_kept_and_checked():
    p = plan("gpt3_6.7b", 16, "trn1", ["parallel.tensor=8", "parallel.pipeline=2", "data.source=synthetic"])
    assert (p.tensor_parallel, p.pipeline_parallel, p.data_parallel, p.num_micro_batches) == (8, 2, 32, 32)
    assert p.stage_layers == [[0, 16], [16, 32]]
    assert p.bubble_fraction == pytest.approx(1 / 33)
    # The 6.7B reference: TP 8 x PP 1 on 16 trn1 nodes, chosen by the planner.
    ref = plan("gpt3_6.7b", 16, "trn1")
    assert (ref.tensor_parallel, ref.pipeline_parallel, ref.data_parallel) == (8, 1, 64)


def test_interleaved_plan_has_virtual_stages_and_a_smaller_bubble():
    sets = ["launch.workers_per_node=2", "parallel.pipeline=2", "train.micro_batch_size=1"]
    plain = plan("tiny", 1, "cpu", sets)
    inter = plan("tiny", 1, "cpu", [*sets, "parallel.virtual_pipeline=2"])
    assert (plain.num_micro_batches, inter.virtual_pipeline) == (8, 2)
    assert plain.stage_layers == [[0, 2], [2, 4]]
    assert inter.stage_layers == [[0, 1], [1, 2], [2, 3], [3, 4]]  # stage k on pipeline rank k % 2
    assert [list(r) for r in inter.stage_ranges] == [[0], [1], [2], [3]]
    assert plain.bubble_fraction == pytest.approx(1 / 9) and inter.bubble_fraction == pytest.approx(1 / 18)


def test_uneven_first_and_last_stages_reach_the_plan():
    p = plan("gpt3_39.1b", 16, "p5", ["parallel.pipeline=4", "parallel.pipeline_first_stage_layers=10",
                                      "parallel.pipeline_last_stage_layers=10"])
    assert p.stage_layers == [[0, 10], [10, 24], [24, 38], [38, 48]]


@pytest.mark.parametrize(("sets", "expected"), [
    # layers not divisible by stages (6.7B has 32)
    (["parallel.pipeline=5"], "model.num_layers=32 does not split evenly into 5 pipeline stage(s)"),
    (["parallel.pipeline=4", "parallel.virtual_pipeline=3"], "does not split evenly into 12 pipeline stage(s)"),
    # fewer micro-batches than stages: 16 p5 nodes at TP 8 x PP 4 have DP 4; 8 samples give 2 micro-batches
    (["parallel.tensor=8", "parallel.pipeline=4", "train.global_batch_size=8"],
     "gives 2 micro-batch(es) per step (micro 1 x DP 4), fewer than the 4 pipeline stages"),
    # virtual stages without a pipeline
    (["parallel.pipeline=1", "parallel.virtual_pipeline=2"],
     "parallel.virtual_pipeline=2 needs parallel.pipeline of 2 or more"),
    # interleaved with micro-batches not a multiple of the stages: DP 8, 24 samples give 3 micro-batches for PP 2
    (["parallel.tensor=8", "parallel.pipeline=2", "parallel.virtual_pipeline=2", "train.global_batch_size=24"],
     "the interleaved schedule needs the micro-batches per step (3) to be a multiple of parallel.pipeline=2"),
    # DP would not be an integer: TP 8 x PP 3 on 16 x 8 GPUs (6.7B's 32 layers do not split in 3 either, so use 48)
    (["parallel.tensor=8", "parallel.pipeline=3", "model.num_layers=48"],
     "TP 8 x PP 3 = 24 does not divide the 128 workers of 16 x p5 (8 per node), so DP would not be an integer; "
     "use --nodes a multiple of 3"),
])
def test_bad_pipelines_are_refused_in_one_line_with_the_fix(sets, expected):
    with pytest.raises(PlanError) as info:
        plan("gpt3_6.7b", 16, "p5", sets)
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert "use --set" in str(info.value) or "use --nodes" in str(info.value) or "use a stage count" in str(info.value)


@pytest.mark.parametrize(("sets", "expected"), [
    (["parallel.pipeline_schedule=gpipe"], "parallel.pipeline_schedule='gpipe' is not a schedule"),
    (["parallel.pipeline=-1"], "parallel.pipeline=-1 must be 0 (the planner chooses) or more"),
    (["parallel.virtual_pipeline=0"], "parallel.virtual_pipeline=0 must be at least 1"),
])
def test_bad_pipeline_keys_are_config_errors(sets, expected):
    with pytest.raises(ConfigError) as info:
        plan("tiny", 1, "cpu", sets)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_recipe_too_big_for_every_mesh_says_why():
    with pytest.raises(PlanError) as info:
        plan("gpt3_310.1b", 1, "trn1")  # 32 NeuronCores of 16 GiB cannot hold 310B parameters
    message = str(info.value)
    assert "no TP x PP works for gpt3_310.1b on 1 x trn1" in message and "the leanest, TP 32 x PP 1" in message
    assert "a platform with more memory per worker" in message
    # A pinned mesh that does not fit points at the planner's own choice.
    with pytest.raises(PlanError) as info:
        plan("gpt3_310.1b", 64, "trn2", ["parallel.tensor=64", "parallel.pipeline=1"])
    assert "--set parallel.tensor=0 --set parallel.pipeline=0 (the planner then picks TP 8 x PP 32)" in str(info.value)


# --- memory --------------------------------------------------------------------------------------------------------

def _layer_bytes(cfg, *, t):
    """Korthikanti et al. 2022, no sequence parallelism, 16-bit: s*b*h*(10 + 24/t + 5*a*s/(h*t))."""
    m, b = cfg.model, cfg.train.micro_batch_size
    return m.seq_length * b * m.hidden_size * (10 + 24 / t + 5 * m.num_attention_heads * m.seq_length
                                               / (m.hidden_size * t))


DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]  # Korthikanti et al. count with dropout


def _io_bytes(cfg, *, first: bool, last: bool) -> float:
    """What a micro-batch keeps outside the layers in 16-bit with dropout: the embedding's 1-byte mask on the first
    stage, the final norm's and the output layer's 2-byte inputs on the last."""
    sbh = cfg.model.seq_length * cfg.train.micro_batch_size * cfg.model.hidden_size
    return sbh * ((1 if first else 0) + (4 if last else 0))


def test_1f1b_first_stage_holds_p_micro_batches_of_its_layers():
    cfg = load_recipe("gpt3_7.5b", ["train.precision=bf16", *DROPOUT])  # no recompute: every activation is kept
    layers, t, p = cfg.model.num_layers, 8, 4
    shape = PipelineShape(stage_layers=(9, 9, 9, 9), pipeline=p, num_micro_batches=32)
    kwargs = dict(padded_vocab=51200, tensor_parallel=t, micro_batch=1, precision="bf16", backend="xla")
    first = estimate_memory(cfg.model, **kwargs, pipeline=shape)
    assert first.pp_rank == 0
    # p micro-batches of L/p layers: as many layer-activations as the whole model without pipelining.
    layer, io = _layer_bytes(cfg, t=t), _io_bytes(cfg, first=True, last=False)
    assert first.activations_gib * GIB == pytest.approx(p * ((layers / p) * layer + io))
    assert [in_flight(r, pipe=shape) for r in range(p)] == [4, 3, 2, 1]
    whole = estimate_memory(cfg.model, **kwargs)
    assert whole.activations_gib * GIB == pytest.approx(layers * layer + _io_bytes(cfg, first=True, last=True))
    # Weights: 9 layers plus the embedding (and its tied copy sits on the last stage, not here).
    assert first.weights_and_optimizer_gib < whole.weights_and_optimizer_gib / 3
    # All forward, then all backward: every one of the 32 micro-batches is in flight.
    afab = estimate_memory(cfg.model, **kwargs, pipeline=dataclasses.replace(shape, schedule="afab"))
    # The last stage is the heaviest then: its 32 micro-batches keep the output layer's inputs (and their logits).
    assert afab.pp_rank == p - 1
    assert afab.activations_gib * GIB == pytest.approx(32 * (9 * layer + _io_bytes(cfg, first=False, last=True)))


def test_interleaved_first_stage_matches_korthikanti():
    cfg = load_recipe("gpt3_7.5b", DROPOUT)
    p, v, t = 4, 3, 8
    shape = PipelineShape(stage_layers=(3,) * 12, pipeline=p, virtual=v, num_micro_batches=32)
    est = estimate_memory(cfg.model, padded_vocab=51200, tensor_parallel=t, micro_batch=1, precision="bf16",
                          backend="xla", pipeline=shape)
    layers = cfg.model.num_layers
    # L * (1 + (p - 1) / (p * v)) layer-activations on the first stage (Korthikanti et al. 2022, 4.2.3); its 15
    # chunk-micro-batches in flight carry the embedding's mask once per micro-batch of the first chunk, which the
    # estimate spreads over the rank's v chunks.
    in_flight_chunks = 2 * (p - 1) + (v - 1) * p + 1
    io = in_flight_chunks * _io_bytes(cfg, first=True, last=False) / v
    assert est.activations_gib * GIB == pytest.approx(layers * (1 + (p - 1) / (p * v)) * _layer_bytes(cfg, t=t) + io)


def test_tied_embeddings_cost_a_copy_on_the_last_stage_only_when_pipelined():
    cfg = load_recipe("gpt3_7.5b")
    vocab, h, s = 51200, cfg.model.hidden_size, cfg.model.max_position_embeddings
    args = dict(padded_vocab=vocab, tensor_parallel=1, micro_batch=1, precision="bf16", backend="xla")  # 8 B/param
    two = PipelineShape(stage_layers=(18, 18), pipeline=2, num_micro_batches=8)
    for tied in (True, False):
        model = dataclasses.replace(cfg.model, tie_embeddings=tied)
        first, last = (e.weights_and_optimizer_gib * GIB / 8 for e in estimate_ranks(model, **args, pipeline=two))
        full = num_parameters(model, padded_vocab=vocab)
        # Every parameter once, plus (tied) the last stage's copy of the word embedding (Megatron's embedding group).
        assert first + last == pytest.approx(full + (vocab * h if tied else 0))
        # first: word embedding + positions; last: output layer (the copy, or its own) + final norm
        assert first - last == pytest.approx(s * h - 2 * h)
        whole = estimate_memory(model, **args)
        assert whole.weights_and_optimizer_gib * GIB / 8 == pytest.approx(full)


def test_bytes_per_parameter_follow_the_precision():
    cfg = load_recipe("gpt3_1.7b")
    est = {(prec, backend): estimate_memory(cfg.model, padded_vocab=50304, tensor_parallel=1, micro_batch=1,
                                            precision=prec, backend=backend).weights_and_optimizer_gib
           for prec, backend in (("bf16", "xla"), ("fp32", "nccl"), ("bf16", "nccl"))}
    n = num_parameters(cfg.model, padded_vocab=50304)
    # pure bf16 on XLA 8; fp32 16; autocast 16 + the 16-bit weight copies autocast caches (2)
    assert [est[k] * GIB / n for k in (("bf16", "xla"), ("fp32", "nccl"), ("bf16", "nccl"))] == \
        pytest.approx([8, 16, 18])


# --- the plan's record ---------------------------------------------------------------------------------------------

def test_plan_json_round_trips_and_refuses_a_hand_edited_pipeline():
    p = plan("gpt3_39.1b", 16, "p5", ["data.source=synthetic"])
    data = json.loads(json.dumps(p.to_json()))
    assert Plan.from_json(data) == p
    for key, value in (("stage_layers", [[0, 24], [25, 48]]), ("bubble_fraction", 0.5),
                       ("num_micro_batches", 1), ("virtual_pipeline", 0)):
        with pytest.raises(PlanError, match="is inconsistent"):
            Plan.from_json({**data, key: value})


def test_plan_json_through_the_cli_has_the_pipeline_keys(capsys):
    assert main(["plan", "--recipe", "gpt3_39.1b", "--nodes", "16", "--platform", "p5", "--json",
                 "--set", "data.source=synthetic", "--set", "parallel.virtual_pipeline=2",
                 "--set", "parallel.choose_layout=fits"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["pipeline_parallel"], out["virtual_pipeline"], out["tensor_parallel"]) == (2, 2, 8)
    assert out["bubble_fraction"] == pytest.approx(1 / (128 + 1) / 2)
    assert out["stage_layers"][0] == [0, 12] and len(out["stage_layers"]) == 4


def test_idle_workers_are_said_by_plan_and_submit_and_launched_as_planned(tmp_path, capsys):
    sets = ["--recipe", "gpt3_1.7b", "--nodes", "512", "--set", "data.source=synthetic"]
    warning = ("the global batch 1024 cannot occupy the 16384 workers of 512 x trn1 (every data-parallel replica "
               "needs a micro-batch of 1 per pipeline stage, and no TP the model and a node allow is wide enough); "
               "planned 16 of 32 workers per node: 8192 workers idle; use --set train.global_batch_size=2048 to use "
               "them all")
    assert main(["plan", *sets]) == 0
    captured = capsys.readouterr()
    assert "gpt3_1.7b on 512 x trn1 (16 of 32 workers per node, backend xla)" in captured.out
    assert "mesh        world 8192 = TP 8 x PP 1 x DP 1024" in captured.out
    assert f"megatron-hpc: warning: {warning}" in captured.err.splitlines()
    assert main(["plan", *sets, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["warnings"][0] == warning
    assert (out["workers_per_node"], out["idle_workers_per_node"], out["global_batch_for_all_workers"]) == \
        (16, 16, 2048)
    run = tmp_path / "run"
    assert main(["submit", *sets, "--dry-run", "--out", str(run)]) == 0
    assert f"megatron-hpc: warning: {warning}" in capsys.readouterr().err.splitlines()
    assert "--nproc_per_node=16 " in (run / "node.sh").read_text()  # torchrun starts the planned 16, not 32
    stored = Plan.from_json(json.loads((run / "plan.json").read_text()))
    assert (stored.workers_per_node, stored.world_size, stored.idle_workers_per_node) == (16, 8192, 16)
    for key, value in (("idle_workers_per_node", 0), ("global_batch_for_all_workers", 1024),
                       ("idle_workers_per_node", -16)):
        with pytest.raises(PlanError, match="is inconsistent"):
            Plan.from_json({**stored.to_json(), key: value})


def test_plan_text_shows_the_pipeline(capsys):
    assert main(["plan", "--recipe", "gpt3_76.1b", "--nodes", "16", "--platform", "p5",
                 "--set", "data.source=synthetic"]) == 0
    text = capsys.readouterr().out
    assert "mesh        world 128 = TP 8 x PP 4 x DP 4" in text
    assert "pipeline    4 stages (15 layers each), 1F1B over 256 micro-batches; bubble 1.2% of the step" in text
    assert main(["plan", "--recipe", "tiny", "--set", "parallel.pipeline_schedule=afab"]) == 0
    captured = capsys.readouterr()
    assert "pipeline    none (PP 1)" in captured.out
    assert "parallel.pipeline_schedule=afab is ignored: this plan has no pipeline (PP 1)" in captured.err


# --- XLA -----------------------------------------------------------------------------------------------------------

def test_pipeline_on_xla_is_planned_with_a_warning_and_refused_by_submit(tmp_path, capsys):
    sets = ["--set", "data.source=synthetic"]
    assert main(["plan", "--recipe", "gpt3_39.1b", "--nodes", "16", *sets]) == 0
    captured = capsys.readouterr()
    assert "TP 8 x PP 4" in captured.out
    warning = [line for line in captured.err.splitlines() if "pipeline parallelism does not run on XLA" in line]
    assert len(warning) == 1 and "ProcessGroupXla" in warning[0] and "`submit` refuses it" in warning[0]
    out = tmp_path / "run"
    assert main(["submit", "--recipe", "gpt3_39.1b", "--nodes", "16", "--dry-run", "--out", str(out), *sets]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pipeline parallelism does not run on XLA in this release" in err[0]
    assert "--set parallel.pipeline=1" in err[0] and "--platform p5" in err[0]
    assert not out.exists()
    # The fix it names: the same model with TP alone fits trn1 (TP 32), and that submits.
    assert main(["submit", "--recipe", "gpt3_39.1b", "--nodes", "16", "--dry-run", "--out", str(out), *sets,
                 "--set", "parallel.pipeline=1"]) == 0
    assert json.loads((out / "plan.json").read_text())["tensor_parallel"] == 32


def test_runtime_check_refuses_only_pipelines_on_xla():
    with pytest.raises(PlanError, match="does not run on XLA"):
        check_pipeline_runtime(plan("neox_20b", 16, "trn2"))
    check_pipeline_runtime(plan("neox_20b", 16, "p5"))
    check_pipeline_runtime(plan("gpt3_6.7b", 16, "trn1"))  # PP 1 on XLA is fine


# --- the two example recipes ---------------------------------------------------------------------------------------

def test_neox_20b_has_the_published_shape_and_architecture(capsys):
    p = plan("neox_20b", 16, "trn1")
    assert (p.tensor_parallel, p.pipeline_parallel, p.data_parallel) == (8, 4, 16)
    assert p.padded_vocab_size == 50432  # the 20B checkpoint's rows, unpadded at TP 8
    # Black et al. 2022 ("GPT-NeoX-20B"), table 1: 20,554,567,680 parameters (untied embeddings, rotary).
    assert p.num_parameters == 20_554_567_680
    assert main(["plan", "--recipe", "neox_20b", "--nodes", "4", "--platform", "p5",
                 "--set", "data.source=synthetic"]) == 0
    err = capsys.readouterr().err
    assert "neox_20b" not in err  # no stand-in caveat: the recipe is NeoX's architecture
    model = load_recipe("neox_20b").model
    assert (model.parallel_residual, model.tie_embeddings, model.rotary_percent) == (True, False, 0.25)


def test_gpt3_175b_is_megatrons_example():
    p = plan("gpt3_175b", 16, "p5", ["data.source=synthetic"])
    assert (p.tensor_parallel, p.pipeline_parallel, p.data_parallel, p.num_micro_batches) == (8, 16, 1, 1536)
    assert p.stage_layers[0] == [0, 6] and len(p.stage_layers) == 16
    assert (p.lr_decay, p.lr_warmup) == (430000, pytest.approx(430))
    assert p.num_parameters / 1e9 == pytest.approx(175, rel=0.01)
    with pytest.raises(PlanError, match="use --nodes a multiple of 16"):
        plan("gpt3_175b", 8, "p5")


def test_plan_text_counts_small_plans_in_mib_and_large_ones_in_gib(capsys):
    """Each part of the memory line is its --json breakdown in the line's unit; tenths of a GiB would show a CPU
    demo's parts as 0.0."""
    import json
    import re

    for recipe, unit, scale in (("tiny", "MiB", 1024), ("gpt3_6.7b", "GiB", 1)):
        args = ["plan", "--recipe", recipe, "--set", "data.source=synthetic"]
        assert main(args) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory"))
        assert main([*args, "--json"]) == 0
        breakdown = json.loads(capsys.readouterr().out)["memory_breakdown_gib"]
        shown = dict(re.findall(r"(weights|grads|Adam|activations|logits) ([\d.]+)", line))
        assert f"{unit} of" in line, line
        assert set(shown) == {"weights", "grads", "Adam", "activations", "logits"}
        assert float(shown["Adam"]) == pytest.approx(breakdown["optimizer"] * scale, abs=0.5 if unit == "MiB" else 0.05)
        assert float(shown["weights"]) > 0, line
