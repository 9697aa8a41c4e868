"""Generation under tensor parallelism: TP=2 (real gloo processes) gives what TP=1 gives, on every rank."""

from __future__ import annotations

import mp_workers
import pytest
import torch.distributed as dist

pytestmark = pytest.mark.multiprocess

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [300, 301, 302]]
RUNS = [dict(max_new_tokens=10),  # greedy: shards exchange only their best (value, id)
        dict(max_new_tokens=10, temperature=1.3, top_k=40, top_p=0.9, seed=5),  # top-k candidates exchanged
        dict(max_new_tokens=10, temperature=0.9, top_p=0.8, seed=6)]  # top-p alone: the full row gathered


def generate_at_tp(rank: int, world: int, ports: list[int], position_embedding: str) -> list[list[tuple]]:
    from megatron_hpc.config.schema import ModelConfig
    from megatron_hpc.generate.engine import generate
    from megatron_hpc.generate.sampling import SamplingParams
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=world), rank=rank)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, max_position_embeddings=32,
                      vocab_size=500, init_method_std=0.2, position_embedding=position_embedding)
    model = GPT(cfg, ctx=ctx, padded_vocab=512, seed=1).eval()  # the init is the same at any TP size
    out = [[(g.tokens, g.logprobs, g.finish_reason) for g in generate(model, PROMPTS, SamplingParams(**run))]
           for run in RUNS]
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("position_embedding", ["learned", "rotary"])
def test_tp2_generates_what_tp1_generates(tmp_path, position_embedding):
    one = mp_workers.spawn(generate_at_tp, world=1, out_dir=tmp_path / "tp1", args=(position_embedding,))[0]
    two = mp_workers.spawn(generate_at_tp, world=2, out_dir=tmp_path / "tp2", args=(position_embedding,))
    assert two[0] == two[1]  # every rank agrees, log-probs included
    for run_one, run_two in zip(one, two[0]):
        for (tok_1, lp_1, why_1), (tok_2, lp_2, why_2) in zip(run_one, run_two):
            assert (tok_2, why_2) == (tok_1, why_1)
            assert max(abs(a - b) for a, b in zip(lp_1, lp_2)) < 1e-4
    assert one[0] != one[1]  # the sampled runs are not greedy in disguise
