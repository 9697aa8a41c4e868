"""The generation loop: left-pad the prompts, prefill the KV cache, then choose and feed one token per step."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_hpc.errors import GenerationError
from megatron_hpc.generate.kv_cache import (
    KVCache,
    cached_forward,
    check_generation_model,
    context_length,
    decode_step,
)
from megatron_hpc.generate.sampling import SamplingParams, VocabShard, next_tokens, token_logprobs
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.device import mark_step

PAD_ID = 0
"""What fills the left padding: any real id does, the padding columns are masked out."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    prompt: list[int]
    tokens: list[int]
    """The new tokens, the stop token included when one ended the row."""
    logprobs: list[float]
    """log p(token) under the model for each new token (before temperature and truncation)."""
    finish_reason: str
    """"stop" (a stop token) or "length" (max_new_tokens reached)."""


def check_prompts(prompts: Sequence[Sequence[int]], *, context: int, max_new_tokens: int, vocab_size: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt needs at least one token")
    for i, p in enumerate(prompts):
        if len(p) > context:
            raise GenerationError(f"prompt {i} is {len(p)} tokens, {len(p) - context} more than the model's "
                                  f"context of {context}; shorten it")
        if len(p) + max_new_tokens > context:
            raise GenerationError(f"prompt {i} ({len(p)} tokens) plus {max_new_tokens} new tokens exceeds the "
                                  f"model's context of {context} by {len(p) + max_new_tokens - context}; ask for at "
                                  f"most {context - len(p)} new tokens")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise GenerationError(f"prompt {i} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})")


def vocab_shard(model: GPT) -> VocabShard:
    owner = model.wte if model.lm_head is None else model.lm_head
    start = model.wte.start if model.lm_head is None else model.tp_rank * owner.weight.shape[0]
    group = model.group if model.tp_size > 1 else None
    return VocabShard(start=start, vocab_size=model.vocab_size, group=group)


def generate(model: GPT, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
    """Continue each prompt (token ids). Under TP every rank of the model's TP group calls this with the same
    prompts and params, and every rank returns the same result."""
    # inference_mode skips autograd's version counters (cheaper than no_grad), but torch_xla 2.9 refuses the TP
    # layers' autograd.Function on inference tensors ("Cannot set version_counter"), so XLA keeps no_grad.
    xla = model.ln_f.weight.device.type == "xla"
    with torch.no_grad() if xla else torch.inference_mode():
        return _generate(model, prompts, params)


def _generate(model: GPT, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
    check_generation_model(model)
    shard = vocab_shard(model)
    check_prompts(prompts, context=context_length(model), max_new_tokens=params.max_new_tokens,
                  vocab_size=shard.vocab_size)
    device = model.ln_f.weight.device
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    ids = torch.tensor([[PAD_ID] * (longest - len(p)) + list(p) for p in prompts], device=device)
    # XLA: a cache as long as the context, so that its shape (and the decode graph) is the same for every request
    # of this batch size, whatever its prompt lengths and max_new_tokens.
    capacity = context_length(model) if device.type == "xla" else longest + params.max_new_tokens
    cache = KVCache.allocate(model, pad=pad, capacity=capacity)
    generator = None
    if not params.greedy:
        # a seedless request still draws the same on every rank until the broadcast settles it
        generator = torch.Generator(device="cpu" if device.type == "xla" else device).manual_seed(
            params.seed if params.seed is not None else secrets.randbits(63))
    # On XLA the stop test and the outputs live on the host, fed by each step's tokens copied there, so that no
    # device graph depends on the step count; elsewhere they stay on the device, written in place.
    xla = device.type == "xla"
    host = torch.device("cpu") if xla else device
    stops = torch.tensor(params.stop_tokens, device=host) if params.stop_tokens else None
    done = torch.zeros(len(prompts), dtype=torch.bool, device=host)
    new = torch.empty(len(prompts), params.max_new_tokens, dtype=torch.long, device=host)
    logps = torch.empty(len(prompts), params.max_new_tokens, dtype=torch.float32, device=host)
    logits = cached_forward(model, ids, cache)  # the prompts in one pass
    steps = params.max_new_tokens
    for step in range(params.max_new_tokens):
        tokens, logp = next_tokens(logits, params, shard, generator)
        # XLA: run this step's graph now. Without the cut, the cache's pending updates would chain into one graph
        # that grows (and compiles again) every step; with it, every decode step is the same graph.
        mark_step(device.type)
        new[:, step].copy_(tokens)  # a host sync on XLA
        logps[:, step].copy_(logp)
        if stops is not None:
            done |= torch.isin(new[:, step], stops)
            if bool(done.all()):  # host sync, once a step and only when stop tokens can end the rows
                steps = step + 1
                break
        if step < params.max_new_tokens - 1:
            # XLA keeps cached_forward's fixed-shape step (one graph for all steps); elsewhere the leaner decode_step
            logits = cached_forward(model, tokens.unsqueeze(1), cache) if xla else decode_step(model, tokens, cache)
    return _results(prompts, new[:, :steps].tolist(), logps[:, :steps].tolist(), set(params.stop_tokens))


@torch.no_grad()
def prompt_logprobs(model: GPT, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
    """log p(token | the tokens before it) of every prompt token after the first (what Megatron's server puts
    before the new tokens' log-probs): one full forward per prompt, so that no padding is involved."""
    check_generation_model(model)
    shard = vocab_shard(model)
    check_prompts(prompts, context=context_length(model), max_new_tokens=0, vocab_size=shard.vocab_size)
    device = model.ln_f.weight.device
    out = []
    for p in prompts:
        ids = torch.tensor([list(p)], device=device)
        logits = model(ids)[0, :-1]  # (S - 1, V/tp): each position predicts the next token
        out.append(token_logprobs(logits, ids[0, 1:], shard).tolist())
    return out


def _results(prompts: Sequence[Sequence[int]], tokens: list[list[int]], logps: list[list[float]],
             stops: set[int]) -> list[Generation]:
    out = []
    for prompt, row, lp in zip(prompts, tokens, logps):
        end = next((i + 1 for i, t in enumerate(row) if t in stops), None)
        out.append(Generation(prompt=list(prompt), tokens=row[:end], logprobs=lp[:end],
                              finish_reason="length" if end is None else "stop"))
    return out
