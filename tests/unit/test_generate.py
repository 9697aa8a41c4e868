"""Generation at TP=1: the KV-cached loop against plain full forward passes (GPT, GPT-NeoX, Llama and Qwen: grouped
keys and values in the cache), sampling options, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import GenerationError
from megatron_hpc.generate.engine import PAD_ID, generate, vocab_shard
from megatron_hpc.generate.kv_cache import KVCache, cached_forward, decode_step
from megatron_hpc.generate.sampling import SamplingParams, next_tokens, sampling_params
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.context import ParallelContext

VOCAB = 500
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [300]]


LLAMA = dict(normalization="rmsnorm", swiglu=True, num_query_groups=2, add_bias_linear=False, tie_embeddings=False,
             position_embedding="rope", rope_scaling="llama3", ffn_hidden_size=128)
"""Llama on the 4 heads: 2 key/value groups of 2 queries, SwiGLU, RMSNorm, no biases, Llama 3.1's RoPE scaling."""
MODELS = ["learned", "rotary", "neox", "llama", "qwen"]


def _cfg(position_embedding: str) -> ModelConfig:
    # a large init std makes the logits spread out, so argmax ties between the two paths are not a concern
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, max_position_embeddings=32,
                      vocab_size=VOCAB, init_method_std=0.2, position_embedding="learned")
    if position_embedding in ("llama", "qwen"):  # Qwen2: Llama with a bias on the QKV projection
        return dataclasses.replace(cfg, **LLAMA, add_qkv_bias=position_embedding == "qwen")
    neox = position_embedding == "neox"  # GPT-NeoX: parallel residual, partial rotary, untied output layer
    return dataclasses.replace(cfg, position_embedding="rope" if neox else position_embedding, parallel_residual=neox,
                               rotary_percent=0.25 if neox else 1.0, tie_embeddings=not neox)


def _model(ctx: ParallelContext, position_embedding: str) -> GPT:
    model = GPT(_cfg(position_embedding), ctx=ctx, padded_vocab=512, seed=1).eval()
    with torch.no_grad():  # biases start at zero: random ones, so that a bias left out of a path shows
        gen = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def _full_forward_greedy(model: GPT, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The reference: the whole sequence through GPT.forward (no cache, no padding) for every new token."""
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1, :VOCAB]
            ids.append(int(logits.argmax()))
            logps.append(float(logits.log_softmax(-1)[ids[-1]]))
    return ids[len(prompt):], logps


@pytest.mark.parametrize("position_embedding", MODELS)
def test_cached_greedy_equals_full_forward_passes(ctx: ParallelContext, position_embedding: str) -> None:
    model = _model(ctx, position_embedding)
    out = generate(model, PROMPTS, SamplingParams(max_new_tokens=12))  # one batch, three lengths (left-padded)
    for prompt, gen in zip(PROMPTS, out):
        tokens, logps = _full_forward_greedy(model, prompt, 12)
        assert gen.tokens == tokens and gen.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(gen.logprobs), torch.tensor(logps), rtol=0, atol=1e-4)


def _prefilled(model: GPT, prompts: list[list[int]]) -> tuple[KVCache, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts])
    cache = KVCache.allocate(model, pad=pad, capacity=longest + 10)
    ids = torch.tensor([[PAD_ID] * (longest - len(p)) + p for p in prompts])
    return cache, cached_forward(model, ids, cache)


@pytest.mark.parametrize("position_embedding", MODELS)
@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["padded", "unpadded"])
def test_decode_step_equals_the_general_cached_forward(ctx: ParallelContext, position_embedding: str,
                                                       prompts: list[list[int]]) -> None:
    """The decode fast path against cached_forward with one column (the plain path), token for token: the same
    greedy tokens, logits and log-probs close, and the same keys and values in the cache."""
    model = _model(ctx, position_embedding)
    shard, params = vocab_shard(model), SamplingParams(max_new_tokens=10)
    (fast, fast_logits), (plain, plain_logits) = _prefilled(model, prompts), _prefilled(model, prompts)
    assert (fast.key_mask is None) == (len(prompts) == 1)
    with torch.inference_mode():
        for _ in range(10):
            tokens, logp = next_tokens(fast_logits, params, shard, None)
            # the plain path's choice: argmax and log_softmax over the real vocabulary only
            real = plain_logits[:, :VOCAB]
            assert torch.equal(tokens, real.argmax(dim=-1))
            torch.testing.assert_close(logp, real.log_softmax(-1).gather(-1, tokens[:, None])[:, 0],
                                       rtol=0, atol=1e-5)
            fast_logits = decode_step(model, tokens, fast)
            plain_logits = cached_forward(model, tokens[:, None], plain)
            torch.testing.assert_close(fast_logits, plain_logits, rtol=0, atol=1e-5)
    assert fast.length == plain.length
    kv_heads = 2 if position_embedding in ("llama", "qwen") else 4  # one per key/value group, not per query head
    assert [t.shape for t in fast.keys + fast.values] == [(len(prompts), kv_heads, fast.keys[0].shape[2], 16)] * 4
    for a, b in zip(fast.keys + fast.values, plain.keys + plain.values):  # decode_step sums in another order (bmm)
        torch.testing.assert_close(a[:, :, :fast.length], b[:, :, :plain.length], rtol=0, atol=1e-5)


def test_training_forward_untouched_by_generation(ctx: ParallelContext) -> None:
    model = GPT(_cfg("rotary"), ctx=ctx, padded_vocab=512, seed=1).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = model(ids)
        generate(model, PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
        assert torch.equal(model(ids), before)


def test_sampling_options(ctx: ParallelContext) -> None:
    model = GPT(_cfg("learned"), ctx=ctx, padded_vocab=512, seed=1).eval()
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=8))
    # top-k 1, and a top-p so small that only the best token survives, are greedy however hot the temperature
    for params in (SamplingParams(max_new_tokens=8, temperature=5.0, top_k=1, seed=1),
                   SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=2)):
        assert [g.tokens for g in generate(model, PROMPTS, params)] == [g.tokens for g in greedy]
    hot = SamplingParams(max_new_tokens=8, temperature=1.5, top_k=50, top_p=0.95, seed=7)
    a, b = generate(model, PROMPTS, hot), generate(model, PROMPTS, hot)
    assert [g.tokens for g in a] == [g.tokens for g in b]  # seeded: reproducible
    other = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.5, top_k=50, top_p=0.95, seed=8))
    assert [g.tokens for g in a] != [g.tokens for g in other]
    assert [g.tokens for g in a] != [g.tokens for g in greedy]
    # top-k: every drawn token is among the k most likely of its step (checked by a full forward pass)
    k = 3
    for prompt, gen in zip(PROMPTS, generate(model, PROMPTS, SamplingParams(max_new_tokens=6, temperature=2.0,
                                                                             top_k=k, seed=3))):
        ids = list(prompt)
        for t in gen.tokens:
            with torch.no_grad():
                best = model(torch.tensor([ids]))[0, -1, :VOCAB].topk(k).indices.tolist()
            assert t in best
            ids.append(t)


def test_stop_tokens_end_each_row(ctx: ParallelContext) -> None:
    model = GPT(_cfg("learned"), ctx=ctx, padded_vocab=512, seed=1).eval()
    free = generate(model, PROMPTS, SamplingParams(max_new_tokens=10))
    stop = free[0].tokens[3]
    out = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, stop_tokens=(stop,)))
    for f, g in zip(free, out):
        end = f.tokens.index(stop) + 1 if stop in f.tokens else len(f.tokens)
        assert g.tokens == f.tokens[:end]
        assert g.finish_reason == ("stop" if stop in f.tokens else "length")
    assert out[0].tokens[-1] == stop and len(out[0].tokens) <= 4


def test_bad_input_one_line_each(ctx: ParallelContext) -> None:
    model = GPT(_cfg("learned"), ctx=ctx, padded_vocab=512, seed=1).eval()
    cases = [
        (lambda: generate(model, [[1] * 40], SamplingParams(max_new_tokens=1)), "40 tokens, 8 more than"),
        (lambda: generate(model, [[1] * 30], SamplingParams(max_new_tokens=5)), "ask for at most 2 new tokens"),
        (lambda: generate(model, [[VOCAB]], SamplingParams(max_new_tokens=1)), "outside the vocabulary"),
        (lambda: SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        (lambda: SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        (lambda: SamplingParams(temperature=-1.0), "temperature must be"),
        (lambda: sampling_params({"topk": 3}), "unknown sampling parameter 'topk'; did you mean 'top_k'?"),
    ]
    for call, words in cases:
        with pytest.raises(GenerationError) as info:
            call()
        assert words in str(info.value) and "\n" not in str(info.value)
    assert sampling_params({"top_k": 3, "stop_tokens": [1, 2]}) == SamplingParams(top_k=3, stop_tokens=(1, 2))


def test_a_tp_size_that_does_not_split_the_model_is_refused_with_the_sizes_that_do() -> None:
    from megatron_hpc.generate.loading import check_tp_size

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, max_position_embeddings=32,
                      vocab_size=500, ffn_hidden_size=96)  # heads 4, MLP 96: gcd 4
    for tp in (1, 2, 4):
        check_tp_size(cfg, tp=tp, source_tp=2)
    with pytest.raises(GenerationError, match=r"tp 3, which does not divide its 4 attention heads and MLP size 96; "
                                              r"run torchrun --nproc_per_node=2 \(the checkpoint's tp\) or another "
                                              r"of \[1, 2, 4\]"):
        check_tp_size(cfg, tp=3, source_tp=2)
    with pytest.raises(GenerationError, match=r"another of \[1, 2, 4\]"):
        check_tp_size(cfg, tp=8, source_tp=2)
    llama = dataclasses.replace(cfg, num_query_groups=2)  # each TP rank holds whole key/value groups
    check_tp_size(llama, tp=2, source_tp=2)
    with pytest.raises(GenerationError, match=r"tp 4, which does not divide its 4 attention heads, 2 key/value groups "
                                              r"and MLP size 96; .* another of \[1, 2\]"):
        check_tp_size(llama, tp=4, source_tp=2)
