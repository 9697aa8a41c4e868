"""The planner: mesh, batch math, padded vocab, memory and FLOPs, and its refusals."""

import pytest

from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import PLATFORMS, get_platform
from megatron_hpc.errors import ConfigError, PlanError
from megatron_hpc.plan.batch import num_micro_batches
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.plan.model_math import flops_per_token, num_parameters
from megatron_hpc.plan.planner import make_plan
from megatron_hpc.plan.vocab import padded_vocab_size


def plan(recipe, nodes, platform=None, overrides=()):
    cfg = load_recipe(recipe, list(overrides))
    return make_plan(cfg, num_nodes=nodes, platform=get_platform(platform or cfg.launch.platform))


def test_gpt3_6_7b_on_16_trn1_nodes():
    p = plan("gpt3_6.7b", 16, "trn1")
    assert (p.tensor_parallel, p.data_parallel, p.world_size, p.num_micro_batches) == (8, 64, 512, 16)
    assert p.padded_vocab_size == 51200
    assert p.workers_per_node == 32


def test_one_node_gives_dp_4():
    p = plan("gpt3_6.7b", 1, "trn1")
    assert (p.world_size, p.data_parallel, p.num_micro_batches) == (32, 4, 256)


@pytest.mark.parametrize("tp, expected", [(1, 50304), (2, 50432), (4, 50688), (8, 51200), (16, 51200),
                                          (32, 53248)])
def test_padded_vocab_matches_megatron_table(tp, expected):
    # megatron-and-launchers.md 4.3, Megatron's own printed values for GPT-2's 50257
    assert padded_vocab_size(50257, divisible_by=128, tensor_parallel=tp) == expected


def test_flops_per_token_of_6_7b_matches_the_published_figure():
    cfg = load_recipe("gpt3_6.7b")
    # 43.11 GFLOP/token for L32 h4096 s2048 V50304 (megatron-and-launchers.md 4.4)
    assert flops_per_token(cfg.model, padded_vocab=50304) / 1e9 == pytest.approx(43.11, abs=0.01)


def test_parameter_count_by_hand():
    cfg = load_recipe("gpt3_6.7b")
    h, layers, v, s = 4096, 32, 51200, 2048
    by_hand = layers * (12 * h * h + 13 * h) + v * h + s * h + 2 * h
    assert num_parameters(cfg.model, padded_vocab=v) == by_hand


def test_mesh_layout_tp_contiguous_dp_strided():
    mesh = Mesh(num_nodes=2, workers_per_node=4, tensor_parallel=2)
    assert mesh.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for rank in range(8):
        assert rank in mesh.tp_group_of(rank) and rank in mesh.dp_group_of(rank)
        assert set(mesh.tp_group_of(rank)) & set(mesh.dp_group_of(rank)) == {rank}


def test_tp_groups_stay_inside_a_node():
    mesh = Mesh(num_nodes=16, workers_per_node=32, tensor_parallel=8)
    for group in mesh.tp_groups():
        assert len({r // 32 for r in group}) == 1


def test_invalid_tp_names_valid_values():
    with pytest.raises(PlanError) as info:
        plan("gpt3_6.7b", 16, "trn1", ["parallel.tensor=3"])
    message = str(info.value)
    assert "parallel.tensor=3" in message and "{1, 2, 8, 16, 32}" in message


def test_global_batch_not_divisible_names_nearest():
    with pytest.raises(PlanError) as info:
        plan("gpt3_6.7b", 16, "trn1", ["train.global_batch_size=1000"])
    assert "global_batch_size=960 or 1024" in str(info.value)
    with pytest.raises(PlanError, match="is not divisible"):
        num_micro_batches(global_batch=10, micro_batch=4, data_parallel=1)


def test_seq_longer_than_positions():
    with pytest.raises(PlanError, match="max_position_embeddings"):
        plan("tiny", 1, "cpu", ["model.seq_length=256"])


def test_nodes_zero():
    with pytest.raises(PlanError, match="at least 1 node"):
        plan("tiny", 0, "cpu")


def test_model_too_big_suggests_tp_or_recompute():
    with pytest.raises(PlanError) as info:
        plan("gpt3_6.7b", 1, "trn1", ["parallel.tensor=1"])
    assert "GiB per worker" in str(info.value)
    assert "--set parallel.tensor=" in str(info.value)


def test_model_that_fits_nowhere_at_pp_1_points_at_pipelining():
    # 310.1B at TP 64 alone does not fit a trn2 worker; the planner's own choice pipelines it.
    with pytest.raises(PlanError) as info:
        plan("gpt3_310.1b", 64, "trn2", ["parallel.pipeline=1"])
    assert "no TP x PP works for gpt3_310.1b on 64 x trn2 (parallel.tensor=any, parallel.pipeline=1)" in str(info.value)
    assert "--set parallel.tensor=0 --set parallel.pipeline=0 (the planner then picks TP 8 x PP 32)" in str(info.value)


def test_workers_per_node_any_on_cpu_and_at_most_the_devices_elsewhere():
    p = plan("tiny", 1, "cpu", ["launch.workers_per_node=2", "parallel.tensor=2"])
    assert (p.world_size, p.tensor_parallel, p.data_parallel) == (2, 2, 1)
    with pytest.raises(PlanError, match="a trn1 node has 32 devices, one worker each; use at most 32"):
        plan("gpt3_6.7b", 1, "trn1", ["launch.workers_per_node=64"])
    # Fewer workers than devices: a slice of the node (here 16 NeuronCores at TP 8 gives DP 2).
    p = plan("gpt3_6.7b", 1, "trn1", ["launch.workers_per_node=16", "train.global_batch_size=32"])
    assert (p.workers_per_node, p.world_size, p.data_parallel) == (16, 16, 2)


def test_unknown_platform():
    with pytest.raises(ConfigError, match="unknown platform"):
        get_platform("tpu")


@pytest.mark.parametrize("platform", ["trn1", "trn2", "p5"])
@pytest.mark.parametrize("nodes", [1, 2, 16, 128, 512])
def test_plan_scales(platform, nodes):
    # 8192 samples is divisible by DP at every size here (DP at most 512 * 64 / 8 = 4096)
    p = plan("gpt3_6.7b", nodes, platform, ["train.global_batch_size=8192"])
    workers = PLATFORMS[platform].workers_per_node
    assert p.world_size == nodes * workers
    assert p.data_parallel * p.tensor_parallel * p.pipeline_parallel == p.world_size
    assert p.micro_batch_size * p.data_parallel * p.num_micro_batches == 8192


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("optim.lr", "-1", "optim.lr=-1.0 must be above 0"),
    ("optim.lr", "0", "optim.lr=0.0 must be above 0"),
    ("train.num_steps", "0", "train.num_steps=0 must be at least 1"),
    ("model.vocab_size", "0", "model.vocab_size=0 must be at least 1"),
    ("parallel.tensor", "-1", "parallel.tensor=-1 must be 0 (the planner chooses) or more"),
    ("model.num_attention_heads", "0", "model.num_attention_heads=0 must be at least 1"),
    ("train.micro_batch_size", "-2", "train.micro_batch_size=-2 must be at least 1"),
    ("model.hidden_dropout", "1.5", "model.hidden_dropout=1.5 must be in [0, 1)"),
    ("checkpoint.keep_last", "0", "checkpoint.keep_last=0 must be at least 1"),
    ("optim.min_lr", "0.5", "optim.min_lr=0.5 is above optim.lr=0.001"),
])
def test_values_that_only_fail_later_are_refused_in_one_line(key, value, expected):
    with pytest.raises(ConfigError) as info:
        plan("tiny", 1, "cpu", [f"{key}={value}"])
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_pipeline_is_a_mesh_dimension_planned_above_one():
    p = plan("tiny", 1, "cpu")
    assert p.pipeline_parallel == 1 and p.mesh.sizes == {"tp": 1, "dp": 1, "pp": 1}
    assert (p.stage_layers, p.bubble_fraction, p.virtual_pipeline, p.pipeline_schedule) == ([[0, 4]], 0.0, 1, "1f1b")
    p = plan("tiny", 1, "cpu", ["launch.workers_per_node=2", "parallel.pipeline=2"])
    assert p.mesh.sizes == {"tp": 1, "dp": 1, "pp": 2} and p.stage_layers == [[0, 2], [2, 4]]
    assert p.num_micro_batches == 2 and p.bubble_fraction == pytest.approx(1 / 3)  # (p - 1) / (m + p - 1)


def test_data_source_resolution():
    assert plan("gpt3_6.7b", 16, "trn1").data_source == "missing"
    assert plan("gpt3_6.7b", 16, "trn1", ["data.path=/fsx/my_text_document"]).data_source == "indexed"
    assert plan("gpt3_6.7b", 16, "trn1", ["data.source=synthetic"]).data_source == "synthetic"
    assert plan("tiny", 1, "cpu", ["data.path=null", "data.source=null"]).data_source == "synthetic"


def test_checkpoint_size_and_lr_schedule_are_planned():
    p = plan("gpt3_6.7b", 16, "trn1")
    # 12 bytes per parameter (fp32 weights and two Adam moments): the reference's ~76 GB (decimal) per save.
    assert p.checkpoint_gib * 2**30 / 1e9 == pytest.approx(6.662e9 * 12 / 1e9, rel=1e-3)
    assert (p.lr_schedule_unit, p.lr_decay) == ("iterations", 123977)
    assert p.lr_warmup == pytest.approx(0.00125 * 123977)
    s = plan("tiny", 1, "cpu", ["optim.lr_warmup_iters=0", "optim.lr_warmup_samples=80"])
    assert (s.lr_schedule_unit, s.lr_warmup, s.lr_decay, s.lr_schedule.per_step) == ("samples", 80, 800, 8)



def test_pythia_6_9b_plans_at_tp_8_with_the_published_parameter_count():
    p = plan("pythia_6.9b", 4)
    assert (p.tensor_parallel, p.pipeline_parallel, p.data_parallel) == (8, 1, 16)
    assert p.padded_vocab_size == 50432  # the shipped rows, unpadded at TP 8
    # Pythia's model card and paper: 6,857,302,016 parameters (untied input and output embeddings over 50432 rows).
    assert p.num_parameters == 6_857_302_016
    cfg = load_recipe("pythia_6.9b")
    assert cfg.warning is None
    assert (cfg.model.parallel_residual, cfg.model.tie_embeddings, cfg.model.rotary_percent) == (True, False, 0.25)
