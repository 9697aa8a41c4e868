"""The planner's memory model against the tensors a step really holds (issue 15, part 4): weights, gradients and
Adam's moments byte for byte, and the activations one micro-batch leaves for backward (saved-tensor hooks) within
10%, on every rank of real gloo processes, for each mode: plain, each recompute setting (with and without dropout,
which decides whether the CPU's attention kernel keeps its scores), the distributed optimizer, TP with and without
sequence parallelism, pipeline stages, and the Llama and Qwen2 layers (RMSNorm, SwiGLU, grouped-query attention, no
linear biases or a QKV bias only)."""

from __future__ import annotations

import dataclasses

import mp_workers
import pytest

from megatron_hpc.config.schema import RunConfig

pytestmark = pytest.mark.multiprocess

RECOMPUTE = {
    "plain": {},
    "selective": {"recompute_granularity": "selective"},
    "uniform1": {"recompute": True},
    "uniform2": {"recompute_granularity": "full", "recompute_num_layers": 2},
    "block1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
}


def _config(*, dropout: float = 0.0, tp: int = 1, pp: int = 1, sp: bool = False, dist_opt: bool = False,
            **model: object) -> RunConfig:
    """4 layers, h 64, 4 heads, s 128 (the s x s scores are 8 x s*b*h here: worth measuring), fp32."""
    cfg = mp_workers.tiny_config(tp=tp)
    m = dataclasses.replace(cfg.model, num_layers=4, seq_length=128, max_position_embeddings=128,
                            hidden_dropout=dropout, attention_dropout=dropout, **model)
    parallel = dataclasses.replace(cfg.parallel, pipeline=pp, sequence_parallel=sp, distributed_optimizer=dist_opt)
    return dataclasses.replace(cfg, model=m, parallel=parallel)


LLAMA = {"normalization": "rmsnorm", "swiglu": True, "num_query_groups": 2, "add_bias_linear": False,
         "position_embedding": "rope", "tie_embeddings": False, "ffn_hidden_size": 96}
"""A Llama-shaped layer: RMSNorm, SwiGLU (FFN 1.5h), 4 heads sharing 2 key/value groups, no linear biases, rotary."""

CASES = {
    1: {**{f"{name}_dropout{d}": _config(dropout=d, **keys) for name, keys in RECOMPUTE.items() for d in (0.0, 0.1)},
        "llama": _config(**LLAMA)},
    2: {"distopt_dp2": _config(dist_opt=True), "tp2": _config(tp=2, dropout=0.1),
        "tp2_sp": _config(tp=2, sp=True, dropout=0.1), "tp2_sp_selective": _config(tp=2, sp=True, dropout=0.1,
                                                                                    **RECOMPUTE["selective"]),
        "pp2": _config(pp=2, dropout=0.1),
        "tp2_neox": _config(tp=2, dropout=0.1, parallel_residual=True, position_embedding="rope",
                            rotary_percent=0.25, tie_embeddings=False),
        # TP 2 splits the 2 key/value groups, SwiGLU's gate and up rows; Qwen2's QKV bias is column-parallel too.
        "tp2_sp_llama": _config(tp=2, sp=True, dropout=0.1, **LLAMA),
        "tp2_qwen_selective": _config(tp=2, add_qkv_bias=True, **LLAMA, **RECOMPUTE["selective"])},
    4: {"tp2_dp2_sp_distopt": _config(tp=2, sp=True, dist_opt=True, dropout=0.1),
        "pp2_dp2_distopt_uniform1": _config(pp=2, dist_opt=True, **RECOMPUTE["uniform1"])},
}


CASES_BY_NAME = {name: cfg for cases in CASES.values() for name, cfg in cases.items()}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict]:
    root = tmp_path_factory.mktemp("memory")
    out = {}
    for world, cases in CASES.items():
        results = mp_workers.spawn(mp_workers.memory_measure, world=world, out_dir=root / f"world{world}",
                                   num_ports=len(cases), args=(list(cases.items()),))
        for rank, per_case in enumerate(results):
            for name, got in per_case.items():
                out[name, rank] = got
    return out


ALL = [(name, rank) for world, cases in CASES.items() for name in cases for rank in range(world)]


@pytest.mark.parametrize("name,rank", ALL)
def test_weights_grads_and_adam_state_are_the_estimate_to_the_byte(measured, name, rank):
    got = measured[name, rank]
    assert (got["weights"], got["grads"]) == (got["est"]["weights"], got["est"]["grads"]), got
    if got["dp_rank"] == 0 or not CASES_BY_NAME[name].parallel.distributed_optimizer:
        assert got["optimizer"] == got["est"]["optimizer"], got


@pytest.mark.parametrize("name", [n for cases in CASES.values() for n, c in cases.items()
                                  if c.parallel.distributed_optimizer])
def test_sharded_moments_cover_every_parameter_once(measured, name):
    # The estimate is a whole slice (DP rank 0's, exact above); the last slice ends in the padding, which has no
    # moments. Over the DP ranks of one (TP, PP) position the slices hold each parameter's two moments once.
    ranks = [got for (n, _), got in measured.items() if n == name]
    for position in {(g["tp_rank"], g["pp_rank"]) for g in ranks}:
        group = [g for g in ranks if (g["tp_rank"], g["pp_rank"]) == position]
        assert len(group) > 1 and len({g["params"] for g in group}) == 1
        assert sum(g["optimizer"] for g in group) == group[0]["params"] * 2 * 4
        assert max(g["optimizer"] for g in group) == group[0]["est"]["optimizer"]


@pytest.mark.parametrize("name,rank", ALL)
def test_saved_activations_are_within_10_percent_of_the_estimate(measured, name, rank):
    got = measured[name, rank]
    assert got["activations"] == pytest.approx(got["est"]["activations"], rel=0.10), got


def test_the_modes_change_what_they_should(measured):
    # Sanity of the measurement itself, independent of the estimate: sharding and recomputation show in the bytes.
    plain, dist = measured["plain_dropout0.0", 0], measured["distopt_dp2", 0]
    assert dist["optimizer"] < 0.51 * plain["optimizer"] and dist["weights"] >= plain["weights"]
    with_dropout = measured["plain_dropout0.1", 0]["activations"]
    assert measured["selective_dropout0.1", 0]["activations"] < 0.5 * with_dropout
    assert measured["uniform1_dropout0.1", 0]["activations"] < 0.2 * with_dropout
    assert measured["tp2_sp", 0]["activations"] < measured["tp2", 0]["activations"]
