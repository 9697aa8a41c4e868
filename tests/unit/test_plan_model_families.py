"""The Llama 2/3 and Qwen2.5 recipes and what the planner counts for their layers: each recipe has its published
shape and parameter count (transformers' LlamaForCausalLM / Qwen2ForCausalLM built on the meta device from the
published config.json values), the FLOPs per token are those of the linears transformers builds, the activations the
estimate counts are what autograd saves for our model, TP divides the key/value groups, and every recipe plans, or
is refused with a fix, on trn1, trn2 and p5 at 16 and 128 nodes, as docs/models.md shows."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers

from megatron_hpc.cli import main as cli_main
from megatron_hpc.config.loader import known_recipes, load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import PlanError
from megatron_hpc.model.gpt import GPT
from megatron_hpc.model.saved_activations import saved_activation_bytes
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.plan.architecture import describe, family, features
from megatron_hpc.plan.memory import GIB, estimate_memory, rank_parameters
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.plan.model_math import flops_per_token, num_parameters
from megatron_hpc.plan.planner import Plan, idle_workers_warning, make_plan, pipeline_runtime_warning
from megatron_hpc.plan.sizing import tensor_candidates
from megatron_hpc.plan.vocab import padded_vocab_size

REPO = Path(__file__).resolve().parents[2]

_LLAMA2 = {"vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
_LLAMA3 = {"vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
PUBLISHED = {
    # The keys of each model's config.json on the Hugging Face hub that fix its shape.
    "llama2_7b": ("LlamaForCausalLM", {**_LLAMA2, "num_hidden_layers": 32, "hidden_size": 4096,
                                       "num_attention_heads": 32, "num_key_value_heads": 32,
                                       "intermediate_size": 11008}),
    "llama2_70b": ("LlamaForCausalLM", {**_LLAMA2, "num_hidden_layers": 80, "hidden_size": 8192,
                                        "num_attention_heads": 64, "num_key_value_heads": 8,
                                        "intermediate_size": 28672}),
    "llama3_8b": ("LlamaForCausalLM", {**_LLAMA3, "num_hidden_layers": 32, "hidden_size": 4096,
                                       "num_attention_heads": 32, "num_key_value_heads": 8,
                                       "intermediate_size": 14336, "max_position_embeddings": 8192}),
    "llama3_70b": ("LlamaForCausalLM", {**_LLAMA3, "num_hidden_layers": 80, "hidden_size": 8192,
                                        "num_attention_heads": 64, "num_key_value_heads": 8,
                                        "intermediate_size": 28672, "max_position_embeddings": 8192}),
    "llama3.1_405b": ("LlamaForCausalLM", {**_LLAMA3, "num_hidden_layers": 126, "hidden_size": 16384,
                                           "num_attention_heads": 128, "num_key_value_heads": 8,
                                           "intermediate_size": 53248, "max_position_embeddings": 131072,
                                           "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8192}}),
    "qwen2.5_7b": ("Qwen2ForCausalLM", {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
                                        "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                                        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                                        "rope_theta": 1000000.0}),
}
PARAMETERS = {  # the model cards' and papers' counts, as transformers builds them (test below)
    "llama2_7b": 6_738_415_616, "llama2_70b": 68_976_648_192, "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496, "llama3.1_405b": 405_853_388_800, "qwen2.5_7b": 7_615_616_512,
}
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "max_position_embeddings")
COUNT_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size")


def _ours(model: ModelConfig) -> dict[str, object]:
    """Our model keys under config.json's names."""
    return {"num_hidden_layers": model.num_layers, "hidden_size": model.hidden_size,
            "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.query_groups,
            "intermediate_size": model.ffn_size, "vocab_size": model.vocab_size,
            "max_position_embeddings": model.max_position_embeddings, "rms_norm_eps": model.layernorm_epsilon,
            "rope_theta": model.rotary_base}


def _hf_model(name: str) -> torch.nn.Module:
    """transformers' model of the published config, on the meta device (no memory)."""
    architecture, published = PUBLISHED[name]
    cls = getattr(transformers, architecture)
    config = cls.config_class(**{k: published[k] for k in COUNT_KEYS}, tie_word_embeddings=False)
    with torch.device("meta"):
        return cls(config)


def test_the_six_recipes_ship():
    assert set(PUBLISHED) <= set(known_recipes())


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_recipe_has_the_published_shape_and_architecture(name):
    model = load_recipe(name).model
    architecture, published = PUBLISHED[name]
    ours = _ours(model)
    assert {k: ours[k] for k in published if k in ours} == {k: v for k, v in published.items() if k in ours}
    assert (model.normalization, model.swiglu, model.add_bias_linear, model.tie_embeddings) == ("rmsnorm", True,
                                                                                               False, False)
    assert (model.position_embedding, model.rotary_percent) == ("rope", 1.0)
    assert model.add_qkv_bias == (architecture == "Qwen2ForCausalLM")  # Qwen2's q/k/v_proj carry a bias
    scaling = published.get("rope_scaling")
    assert model.rope_scaling == (scaling["rope_type"] if scaling else "none")
    if scaling:
        assert (model.rope_scaling_factor, model.rope_low_freq_factor, model.rope_high_freq_factor,
                model.rope_original_max_position) == (scaling["factor"], scaling["low_freq_factor"],
                                                      scaling["high_freq_factor"],
                                                      scaling["original_max_position_embeddings"])
    assert family(model) == ("qwen2" if model.add_qkv_bias else "llama")


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_parameter_count_is_transformers_at_every_tp_the_model_allows(name):
    model = load_recipe(name).model
    theirs = sum(p.numel() for p in _hf_model(name).parameters())
    assert theirs == PARAMETERS[name]
    # make_vocab_size_divisible_by 1 keeps the published rows at every TP the groups allow (trn2 offers 1..64).
    sizes = tensor_candidates(load_recipe(name), get_platform("trn2"), per_node=64)
    assert max(sizes) == model.query_groups
    for tp in sizes:
        vocab = padded_vocab_size(model.vocab_size, divisible_by=model.make_vocab_size_divisible_by,
                                  tensor_parallel=tp)
        assert vocab == model.vocab_size
        assert num_parameters(model, padded_vocab=vocab) == theirs


@pytest.mark.parametrize("name", PUBLISHED)
def test_flops_per_token_are_six_per_weight_of_transformers_linears_plus_the_attention_scores(name):
    model = load_recipe(name).model
    linears = sum(m.weight.numel() for m in _hf_model(name).modules() if isinstance(m, torch.nn.Linear))
    scores = 12 * model.num_layers * model.seq_length * model.hidden_size  # QK^T and PV, forward and backward
    assert flops_per_token(model, padded_vocab=model.vocab_size) == pytest.approx(6 * linears + scores, rel=1e-12)


def test_plan_json_gives_the_architecture_it_counted(capsys):
    assert cli_main.main(["plan", "--recipe", "qwen2.5_7b", "--nodes", "16", "--set", "data.source=synthetic",
                          "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_parameters"] == PARAMETERS["qwen2.5_7b"]  # the existing keys stay
    assert out["model"] == features(load_recipe("qwen2.5_7b").model)
    assert {k: out["model"][k] for k in ("family", "num_query_groups", "head_dim", "swiglu", "add_qkv_bias",
                                         "qkv_rows", "mlp_matrices")} == {
        "family": "qwen2", "num_query_groups": 4, "head_dim": 128, "swiglu": True, "add_qkv_bias": True,
        "qkv_rows": (28 + 2 * 4) * 128, "mlp_matrices": 3}


def test_the_model_line_names_what_differs_from_gpt3():
    assert describe(load_recipe("gpt3_6.7b").model) == ""
    assert describe(load_recipe("llama3.1_405b").model) == (
        "RMSNorm, SwiGLU, GQA 128 heads / 8 groups, no linear biases, rotary base 500000, llama3 scaling x8, "
        "untied output")
    assert "QKV bias only" in describe(load_recipe("qwen2.5_7b").model)
    assert describe(dataclasses.replace(load_recipe("tiny").model, num_query_groups=1)) == "MQA"


# --- the model as the planner counts it: parameters per rank and activations, in one process ----------------------

TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
                   vocab_size=128, normalization="rmsnorm", swiglu=True, num_query_groups=2, add_bias_linear=False,
                   position_embedding="rope", tie_embeddings=False, ffn_hidden_size=96)
VARIANTS = {
    "llama": {},
    "qwen_mqa": {"add_qkv_bias": True, "num_query_groups": 1},
    "llama_dropout": {"hidden_dropout": 0.1, "attention_dropout": 0.1},  # the CPU's math attention keeps scores
    "swiglu_with_biases_tied": {"add_bias_linear": True, "tie_embeddings": True, "normalization": "layernorm"},
    "llama_selective": {"recompute_granularity": "selective"},
}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ParallelContext]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    yield ParallelContext.build(Mesh(num_nodes=1, workers_per_node=1, tensor_parallel=1), rank=0)
    dist.destroy_process_group()


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameters_and_saved_activations_are_the_estimate(ctx: ParallelContext, variant: str):
    cfg = dataclasses.replace(TINY, **VARIANTS[variant])
    model = GPT(cfg, ctx=ctx, padded_vocab=128, seed=1)
    built = sum(p.numel() for p in model.parameters())
    assert built == num_parameters(cfg, padded_vocab=128)
    assert built == rank_parameters(cfg, padded_vocab=128, tensor_parallel=1, layers=2, first=True, last=True)
    ids = torch.randint(0, 128, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    saved = saved_activation_bytes(model, [ids])
    est = estimate_memory(cfg, padded_vocab=128, tensor_parallel=1, micro_batch=2, precision="fp32",
                          backend="gloo").micro_batch_activations_gib * GIB
    # Left out by the estimate: the norms' statistics and the log-sum-exp (about 1% at h = 64).
    assert saved == pytest.approx(est, rel=0.03), (saved, est)


def test_fewer_key_value_groups_and_no_gate_keep_less():
    """The terms that GQA and SwiGLU change, in a 16-bit layer at TP 1 (elements of s*b*h: Q 1, K and V 2G/nh, the
    rotated Q and K 1 + G/nh, attention output 1, FFN 4 or 2 tensors of ffn/h, six norm tensors)."""
    def per_layer(**keys: object) -> float:
        cfg = dataclasses.replace(TINY, num_layers=1, **keys)
        return estimate_memory(cfg, padded_vocab=128, tensor_parallel=1, micro_batch=1, precision="bf16",
                               backend="xla").micro_batch_activations_gib * GIB
    sbh2 = 128 * 64 * 2  # one s*b*h tensor in 16-bit
    assert per_layer(num_query_groups=4) - per_layer(num_query_groups=2) == pytest.approx(sbh2 * (1 + 0.5))
    assert per_layer(num_query_groups=2) - per_layer(num_query_groups=1) == pytest.approx(sbh2 * (0.5 + 0.25))
    assert per_layer() - per_layer(swiglu=False) == pytest.approx(sbh2 * 2 * 96 / 64)


# --- TP splits whole key/value groups ------------------------------------------------------------------------------

def test_tp_must_divide_the_groups_and_the_planner_never_picks_more():
    cfg = load_recipe("llama3_70b", ["data.source=synthetic"])
    assert tensor_candidates(cfg, get_platform("trn1"), per_node=32) == [1, 2, 8]
    with pytest.raises(PlanError, match=r"parallel.tensor=16 is invalid for llama3_70b on trn1 \(it must divide the "
                                        r"8 key/value groups .*\); .* use --set parallel.tensor=8 "):
        make_plan(load_recipe("llama3_70b", ["parallel.tensor=16", "data.source=synthetic"]), num_nodes=16,
                  platform=get_platform("trn1"))
    # 8192 trn2 workers and a 512-sample batch: without TP 16 the planner idles workers rather than split a group.
    plan = make_plan(load_recipe("llama3_8b", ["data.source=synthetic"]), num_nodes=128,
                     platform=get_platform("trn2"))
    assert plan.tensor_parallel == 8 and plan.idle_workers_per_node == 32


def test_the_cli_takes_a_recipe_name_with_a_dot(capsys):
    assert load_recipe("llama3.1_405b").name == "llama3.1_405b"
    assert cli_main.main(["plan", "--recipe", "llama3.1_405b", "--nodes", "16", "--set", "data.source=synthetic"]) == 0
    assert capsys.readouterr().out.startswith("recipe      llama3.1_405b on 16 x p5")


# --- every recipe on trn1, trn2 and p5 at 16 and 128 nodes, as docs/models.md tables it -----------------------------

MESH = re.compile(r"^TP (\d+) x PP (\d+) x DP (\d+), ([\d.]+) GiB")


def _doc_cells() -> dict[tuple[str, str, int], str]:
    """(recipe, platform, nodes) -> the cell of docs/models.md's plan tables."""
    cells, header = {}, None
    for line in (REPO / "docs" / "models.md").read_text().splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if not cols:
            header = None
        elif cols[0] == "recipe" and all(re.fullmatch(r"\S+ x \d+", c) for c in cols[1:]):
            header = [(c.split(" x ")[0], int(c.split(" x ")[1])) for c in cols[1:]]
        elif header and cols[0].startswith("`"):
            for (platform, nodes), cell in zip(header, cols[1:]):
                cells[cols[0].strip("`"), platform, nodes] = cell
    return cells


CELLS = _doc_cells()
GRID = [(name, platform, nodes) for name in PUBLISHED for platform in ("trn1", "trn2", "p5") for nodes in (16, 128)]


def test_the_doc_tables_cover_every_recipe_platform_and_size():
    assert sorted(CELLS) == sorted(GRID)


@pytest.mark.parametrize("name,platform,nodes", GRID)
def test_a_recipe_plans_or_is_refused_with_a_fix_as_the_doc_says(name, platform, nodes):
    cfg = load_recipe(name, ["data.source=synthetic"])
    cell = CELLS[name, platform, nodes]
    try:
        plan = make_plan(cfg, num_nodes=nodes, platform=get_platform(platform))
    except PlanError as exc:
        message = str(exc)
        assert cell.startswith("refused"), f"{name} on {nodes} x {platform}: the doc shows {cell!r}; {message}"
        assert "\n" not in message and "; use " in message  # one line that names what to do
        for nodes_fix in re.findall(r"at (\d+) nodes", cell):
            assert f"(use --nodes {nodes_fix})" in message, message
        for fix in re.findall(r"`(--set [^`]+)`", cell):
            assert fix in message, message
        return
    _check_plan(plan, cfg.model.vocab_size, cell)


def _check_plan(plan: Plan, vocab: int, cell: str) -> None:
    shown = MESH.match(cell)
    assert shown, f"{plan.recipe} on {plan.num_nodes} x {plan.platform} plans; the doc shows {cell!r}"
    mesh = (plan.tensor_parallel, plan.pipeline_parallel, plan.data_parallel)
    assert mesh == tuple(int(g) for g in shown.groups()[:3]), cell
    assert f"{plan.memory_per_worker_gib:.1f}" == shown.group(4), cell
    assert plan.padded_vocab_size == vocab  # the published rows, unpadded
    assert sum(plan.memory_breakdown_gib.values()) == pytest.approx(plan.memory_per_worker_gib, abs=0.01)
    assert plan.memory_per_worker_gib <= 0.9 * plan.memory_limit_gib
    assert len(plan.stage_layers) == plan.pipeline_parallel * plan.virtual_pipeline
    assert ("PP does not run on XLA" in cell) == (pipeline_runtime_warning(plan) is not None), cell
    assert ("workers idle" in cell) == (idle_workers_warning(plan) is not None), cell


def test_plan_json_shows_the_rope_scaling_and_norm_values_a_set_changed(capsys):
    # docs/models.md: `plan --json` gives the keys of the table under "model"; a script checks its --set took.
    sets = ["model.rope_scaling_factor=16", "model.rope_low_freq_factor=2", "model.rope_high_freq_factor=8",
            "model.rope_original_max_position=4096", "model.layernorm_epsilon=1e-6"]
    assert cli_main.main(["plan", "--recipe", "llama3.1_405b", "--nodes", "16", "--platform", "p5", "--json",
                          "--set", "data.source=synthetic", *(a for s in sets for a in ("--set", s))]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert {k: model[k] for k in ("rope_scaling", "rope_scaling_factor", "rope_low_freq_factor",
                                  "rope_high_freq_factor", "rope_original_max_position", "layernorm_epsilon",
                                  "rotary_percent")} == {
        "rope_scaling": "llama3", "rope_scaling_factor": 16.0, "rope_low_freq_factor": 2.0,
        "rope_high_freq_factor": 8.0, "rope_original_max_position": 4096, "layernorm_epsilon": 1e-6,
        "rotary_percent": 1.0}
    assert "rope_scaling_factor" not in features(load_recipe("llama3_8b").model)  # no scaling, no factors
