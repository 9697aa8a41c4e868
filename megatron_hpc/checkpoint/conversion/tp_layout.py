"""How each weight of our GPT is split across TP ranks, and merging / splitting whole checkpoints by it.

The rules are Megatron's (megatron-and-launchers.md 3.3-3.4): column-parallel weights and their biases
(attention QKV, MLP fc) are split on dim 0; row-parallel weights (attention and MLP output projections) on
dim 1, their biases replicated; the word embeddings and an untied output layer by vocabulary rows (dim 0,
over the padded vocabulary); LayerNorms and learned positions are replicated. The QKV rows are in
Megatron's per-head order [heads, (q, k, v), head dim], so a row block holds whole heads at any TP size.
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_hpc.errors import CheckpointError

Split = Literal["rows", "columns", "vocab", "replicated"]

_ROWS = (".attn.qkv.weight", ".attn.qkv.bias", ".mlp.fc.weight", ".mlp.fc.bias", ".mlp.gate.weight", ".mlp.gate.bias")
_COLUMNS = (".attn.proj.weight", ".mlp.proj.weight")
_VOCAB = ("wte.weight", "lm_head.weight")


def split_of(name: str) -> Split:
    if name in _VOCAB:
        return "vocab"
    if name.endswith(_ROWS):
        return "rows"
    if name.endswith(_COLUMNS):
        return "columns"
    return "replicated"


def merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every TP rank's shard (in TP rank order)."""
    how = split_of(name)
    if how == "replicated" or len(shards) == 1:
        return shards[0]
    return torch.cat(shards, dim=1 if how == "columns" else 0)


def split(name: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """One contiguous shard per TP rank."""
    how = split_of(name)
    if how == "replicated":
        return [full] * tp
    dim = 1 if how == "columns" else 0
    if full.shape[dim] % tp:
        raise CheckpointError(f"{name} has {full.shape[dim]} {'columns' if dim else 'rows'}, not divisible by "
                              f"tp={tp}; pick a TP size that divides the heads and the FFN size")
    return [t.clone() for t in full.chunk(tp, dim=dim)]


def repad_vocab(full: torch.Tensor, *, vocab_size: int, padded: int) -> torch.Tensor:
    """Rows [0, vocab_size) are real tokens; the padding rows are trimmed, or grown by repeating the last
    real row (as Megatron's checkpoint saver does), so real-token logits do not change."""
    real = full[:vocab_size]
    if padded <= full.shape[0]:
        return torch.cat([real, full[vocab_size:padded]]) if padded > vocab_size else real.clone()
    extra = padded - full.shape[0]
    return torch.cat([full, real[-1:].expand(extra, -1)])


def merge_model(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights from every TP rank's model state dict."""
    names = list(shards[0])
    for r, shard in enumerate(shards[1:], start=1):
        if list(shard) != names:
            raise CheckpointError(f"TP rank {r} holds other weights than rank 0; the checkpoint is not one model")
    return {name: merge(name, [s[name] for s in shards]) for name in names}


def split_model(full: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in full.items():
        for rank, piece in enumerate(split(name, tensor, tp)):
            out[rank][name] = piece
    return out
