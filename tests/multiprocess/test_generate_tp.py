"""Generation under tensor parallelism: TP=2 (real gloo processes) gives what TP=1 gives, on every rank, for GPT
(learned and rotary positions) and a tiny Llama (grouped-query attention, SwiGLU, RMSNorm, RoPE scaling), whose KV
cache holds its key/value groups, not its heads: one group per rank at TP 2."""

from __future__ import annotations

from typing import Any

import mp_workers
import pytest
import torch.distributed as dist

pytestmark = pytest.mark.multiprocess

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [300, 301, 302]]
RUNS = [dict(max_new_tokens=10),  # greedy: shards exchange only their best (value, id)
        dict(max_new_tokens=10, temperature=1.3, top_k=40, top_p=0.9, seed=5),  # top-k candidates exchanged
        dict(max_new_tokens=10, temperature=0.9, top_p=0.8, seed=6)]  # top-p alone: the full row gathered
MODELS = ["learned", "rotary", "llama"]


def _model_config(name: str) -> Any:
    import dataclasses

    from megatron_hpc.config.schema import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, max_position_embeddings=32,
                      vocab_size=500, init_method_std=0.2,
                      position_embedding="learned" if name == "learned" else "rope")
    if name == "llama":
        cfg = dataclasses.replace(cfg, **mp_workers.LLAMA)
    return cfg


def generate_at_tp(rank: int, world: int, ports: list[int]) -> dict[str, Any]:
    """For each of MODELS: the RUNS' (tokens, log-probs, finish reason) per prompt, and the shapes of the KV cache
    buffers that generate allocated (keys and values of every layer)."""
    from megatron_hpc.generate.engine import generate
    from megatron_hpc.generate.kv_cache import KVCache
    from megatron_hpc.generate.sampling import SamplingParams
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh

    shapes: list[list[tuple[int, ...]]] = []
    allocate = KVCache.allocate.__func__

    def recording(cls: type, model: GPT, **kwargs: Any) -> KVCache:
        cache = allocate(cls, model, **kwargs)
        shapes.append([tuple(t.shape) for t in cache.keys + cache.values])
        return cache

    KVCache.allocate = classmethod(recording)  # this worker process only
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=world), rank=rank)
    out: dict[str, Any] = {}
    for name in MODELS:
        model = GPT(_model_config(name), ctx=ctx, padded_vocab=512, seed=1).eval()  # the init is the same at any TP
        shapes.clear()
        runs = [[(g.tokens, g.logprobs, g.finish_reason) for g in generate(model, PROMPTS, SamplingParams(**run))]
                for run in RUNS]
        out[name] = {"runs": runs, "cache_shapes": list(shapes)}
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """generate_at_tp at world 1 and world 2 (every model in one spawn each): world size -> each rank's result."""
    root = tmp_path_factory.mktemp("generate_tp")
    return {world: mp_workers.spawn(generate_at_tp, world=world, out_dir=root / f"tp{world}") for world in (1, 2)}


@pytest.mark.parametrize("name", MODELS)
def test_tp2_generates_what_tp1_generates(generated: dict[int, list[dict[str, Any]]], name: str) -> None:
    one, two = generated[1][0][name]["runs"], [rank[name]["runs"] for rank in generated[2]]
    assert two[0] == two[1]  # every rank agrees, log-probs included
    for run_one, run_two in zip(one, two[0]):
        for (tok_1, lp_1, why_1), (tok_2, lp_2, why_2) in zip(run_one, run_two):
            assert (tok_2, why_2) == (tok_1, why_1)  # greedy and seeded sampling alike, token for token
            assert max(abs(a - b) for a, b in zip(lp_1, lp_2)) < 1e-4
    assert one[0] != one[1]  # the sampled runs are not greedy in disguise


def test_the_kv_cache_holds_key_value_groups_split_over_tp(generated: dict[int, list[dict[str, Any]]]) -> None:
    """(B, heads or groups / tp, capacity, head_dim) per layer, keys and values: Llama's 2 groups are 1 a rank at
    TP 2, where GPT keeps its 4 heads, 2 a rank."""
    capacity = max(len(p) for p in PROMPTS) + RUNS[0]["max_new_tokens"]
    for world, kv_heads in ((1, {"rotary": 4, "llama": 2}), (2, {"rotary": 2, "llama": 1})):
        for rank in generated[world]:
            for name, per_rank in kv_heads.items():
                caches = rank[name]["cache_shapes"]
                assert len(caches) == len(RUNS)  # one cache per generate call
                for shapes in caches:
                    assert shapes == [(len(PROMPTS), per_rank, capacity, 16)] * 4, (world, name, shapes)
