"""Megatron's tensor-parallel layers, batch-first.

Shape legend: B batch, S sequence, H hidden, V padded vocabulary, tp the TP size; `/tp` marks the
dim that is sharded across the TP group.

Initialisation is TP-invariant (Megatron's --use-cpu-initialization): each layer draws its FULL
weight on the CPU from a generator seeded by (seed, key) and keeps its shard, so a TP=2 model and
a TP=1 model with the same seed hold the same full weights. Sharded parameters carry
`tensor_parallel = True` so the grad-norm can count replicated ones once.

With `sequence_parallel` (Korthikanti et al. 2022) the layers' replicated side holds sequence shards (B, S/tp, H):
a column-parallel input is all-gathered along the sequence (its backward reduce-scatters), a row-parallel output
and the embedding output are reduce-scattered instead of all-reduced.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.mappings import (
    copy_to_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    sequence_gather_linear,
)


def seeded_normal(shape: tuple[int, ...], *, std: float, seed: int, key: str) -> torch.Tensor:
    """A full CPU tensor ~ N(0, std^2) that depends only on (seed, key, shape)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


def _shard(full: torch.Tensor, *, dim: int, ctx: ParallelContext) -> torch.Tensor:
    size = full.shape[dim]
    if size % ctx.tp_size:
        raise ValueError(f"dim {dim} of size {size} is not divisible by tp={ctx.tp_size}")
    return full.chunk(ctx.tp_size, dim=dim)[ctx.tp_rank].clone()


def _sharded_param(data: torch.Tensor) -> nn.Parameter:
    param = nn.Parameter(data)
    param.tensor_parallel = True  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows (output features): (B, S, H_in) -> (B, S, H_out/tp).

    With sequence_parallel the input is (B, S/tp, H_in), all-gathered to the full sequence first."""

    def __init__(self, in_features: int, out_features: int, *, ctx: ParallelContext, bias: bool = True,
                 init_std: float, seed: int, key: str, sequence_parallel: bool = False):
        super().__init__()
        self.group = ctx.tp_group
        self.sequence_parallel = sequence_parallel
        full = seeded_normal((out_features, in_features), std=init_std, seed=seed, key=key)
        self.weight = _sharded_param(_shard(full, dim=0, ctx=ctx))
        self.bias = _sharded_param(torch.zeros(out_features // ctx.tp_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return sequence_gather_linear(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by columns (input features): (B, S, H_in/tp) -> (B, S, H_out).

    With sequence_parallel the output is (B, S/tp, H_out), reduce-scattered along the sequence, and the bias is
    added to that shard (so its gradient is partial on each TP rank: the model tags it `sequence_parallel`)."""

    def __init__(self, in_features: int, out_features: int, *, ctx: ParallelContext, bias: bool = True,
                 init_std: float, seed: int, key: str, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.tp_size = ctx.tp_group, ctx.tp_size
        self.sequence_parallel = sequence_parallel
        full = seeded_normal((out_features, in_features), std=init_std, seed=seed, key=key)
        self.weight = _sharded_param(_shard(full, dim=1, ctx=ctx))
        # The bias is replicated and added once, after the partial sums are reduced.
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # one addmm with the bias folded in
            return F.linear(x, self.weight, self.bias)
        reduce = reduce_scatter_to_sequence_region if self.sequence_parallel else reduce_from_tp_region
        y = reduce(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token lookup with the table split by vocabulary rows: (B, S) ids -> (B, S, H).

    Rows [vocab_size, padded) are padding; they are drawn after the real rows so that the real
    rows do not depend on the padding (which depends on TP).
    With sequence_parallel the partial lookups are reduce-scattered: (B, S) ids -> (B, S/tp, H).
    """

    def __init__(self, padded_vocab: int, dim: int, *, ctx: ParallelContext, vocab_size: int,
                 init_std: float, seed: int, key: str, sequence_parallel: bool = False):
        super().__init__()
        self.group = ctx.tp_group
        self.sequence_parallel = sequence_parallel
        real = seeded_normal((vocab_size, dim), std=init_std, seed=seed, key=key)
        pad = seeded_normal((padded_vocab - vocab_size, dim), std=init_std, seed=seed, key=key + ".pad")
        self.weight = _sharded_param(_shard(torch.cat([real, pad]), dim=0, ctx=ctx))
        self.tp_size = ctx.tp_size
        self.per_rank = padded_vocab // ctx.tp_size
        self.start = ctx.tp_rank * self.per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # the whole table is here: no masking, no reduce
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, S, H), partial
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(emb, self.group)
        return reduce_from_tp_region(emb, self.group)
