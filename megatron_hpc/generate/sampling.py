"""Choosing the next token from vocab-parallel logits: greedy, temperature, top-k, top-p; and its log-prob.

Each TP rank holds the logits of its vocabulary shard, (B, V/tp). Only what the choice needs crosses ranks:
greedy exchanges each shard's best (value, id), (B, 2) per rank; top-k exchanges each shard's k best; top-p
alone needs the whole distribution and gathers the full (B, V) row. Every rank then makes the same choice, and
TP rank 0's draw is broadcast so that no rank can drift. Log-probs are those of the model's own distribution
(log_softmax of the raw logits, before temperature and truncation, as Megatron reports them): each shard's
logsumexp is exchanged, not its logits.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from megatron_hpc.errors import GenerationError


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 32
    """Tokens to generate per prompt at most (fewer when every row meets a stop token)."""
    temperature: float = 0.0
    """0: greedy (the most likely token); above 0 the logits are divided by it and a token is drawn."""
    top_k: int = 0
    """Draw among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Draw among the most likely tokens whose probabilities sum to at least p, in (0, 1] (1: all)."""
    seed: int | None = None
    """Seed of the draws; None: a fresh one."""
    stop_tokens: tuple[int, ...] = ()
    """A row stops after emitting one of these (it is kept in the output)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be a positive integer, not {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise GenerationError(f"temperature must be 0 (greedy) or positive, not {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise GenerationError(f"top_k must be 0 (off) or a positive integer, not {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise GenerationError(f"top_p must be in (0, 1], not {self.top_p!r}; use 1 to turn it off")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sampling_params(values: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams from a request's mapping; an unknown name is refused with the closest valid one."""
    valid = [f.name for f in fields(SamplingParams)]
    for key in values:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(valid)}"
            raise GenerationError(f"unknown sampling parameter {key!r}{hint}")
    given = dict(values)
    if "stop_tokens" in given:
        given["stop_tokens"] = tuple(given["stop_tokens"])
    return SamplingParams(**given)


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabShard:
    """Which global token ids this rank's logits columns are, and the group that holds the other shards."""
    start: int
    vocab_size: int
    """The tokenizer's vocabulary: columns at or past it are padding and never chosen."""
    group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)


def _gather(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Every rank's x (B, n) side by side in rank order: (B, tp * n)."""
    if shard.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    return torch.cat(parts, dim=-1)


def _masked(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    ids = torch.arange(shard.start, shard.start + local.shape[-1], device=local.device)
    return local.float().masked_fill(ids >= shard.vocab_size, -math.inf)


def _truncate(logits: torch.Tensor, *, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely columns whose probability reaches top_p (the first always)."""
    if top_p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    before = sorted_logits.softmax(dim=-1).cumsum(dim=-1) - sorted_logits.softmax(dim=-1)  # mass above each
    drop = before >= top_p
    drop[..., 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))


def next_tokens(local: torch.Tensor, params: SamplingParams, shard: VocabShard,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """From this rank's logits (B, V/tp): the chosen token ids (B,) int64 and their log-probs (B,), the same on
    every rank of the shard's group."""
    if params.greedy and shard.size == 1:
        # One shard holds the whole row: a view without the padding columns replaces the masked copy and the
        # exchange of (value, id) pairs. The same choice (the first maximum) and the same log-prob.
        logits = local[:, :shard.vocab_size - shard.start].float()  # (B, V) a view when the logits are fp32
        best, tokens = logits.max(dim=-1)
        return tokens, best - torch.logsumexp(logits, dim=-1)
    logits = _masked(local, shard)  # (B, V/tp) fp32
    if params.greedy:
        best, arg = logits.max(dim=-1)
        pairs = _gather(torch.stack([best, (arg + shard.start).float()], dim=-1), shard)  # (B, 2 tp)
        values, ids = pairs[:, 0::2], pairs[:, 1::2]
        # the highest value; among equal ones the lowest id, as an unsharded argmax would pick
        top = values.max(dim=-1, keepdim=True).values
        tokens = ids.masked_fill(values < top, math.inf).min(dim=-1).values.long()
    else:
        tokens = _draw(logits, params, shard, generator)
    return tokens, _logprobs(logits, tokens, shard)


def _draw(logits: torch.Tensor, params: SamplingParams, shard: VocabShard,
          generator: torch.Generator | None) -> torch.Tensor:
    scaled = logits / params.temperature
    if params.top_k:
        k = min(params.top_k, scaled.shape[-1])
        values, ids = scaled.topk(k, dim=-1)  # each shard's k best; the global k best are among them
        values, ids = _gather(values, shard), _gather(ids + shard.start, shard)  # (B, tp k)
        values, pick = values.topk(min(params.top_k, values.shape[-1]), dim=-1)
        ids = ids.gather(-1, pick)
    else:
        # (B, V): top-p needs the whole distribution. The padding columns go: the draw then depends on the real
        # vocabulary only, not on the padded size (which grows with TP), so TP 2 draws what TP 1 draws.
        values = _gather(scaled, shard)[:, :shard.vocab_size]
        ids = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    probs = _truncate(values, top_p=params.top_p).softmax(dim=-1)
    if generator is not None and generator.device != probs.device:  # XLA: torch_xla has no Generator; draw on the host
        chosen = torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device)  # host sync
    else:
        chosen = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
    tokens = ids.gather(-1, chosen).squeeze(-1).long()
    if shard.size > 1:
        dist.broadcast(tokens, src=dist.get_global_rank(shard.group, 0), group=shard.group)
    return tokens


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    lse = torch.logsumexp(_gather(torch.logsumexp(logits, dim=-1, keepdim=True), shard), dim=-1)  # (B,)
    local = tokens - shard.start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(mine, picked, torch.zeros_like(picked))
    if shard.size > 1:
        dist.all_reduce(picked, group=shard.group)  # exactly one shard holds each token
    return picked - lse


def token_logprobs(local: torch.Tensor, tokens: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """log p(tokens) (N,) under this rank's logits (N, V/tp) of N positions, the same on every rank."""
    return _logprobs(_masked(local, shard), tokens, shard)
