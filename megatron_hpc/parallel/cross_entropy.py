"""Cross entropy over vocabulary-sharded logits, without ever gathering the full logits.

Each TP rank holds logits (B, S, V/tp) for a contiguous slice of the padded vocabulary. Three
all-reduces of (B, S) tensors replace a gather of (B, S, V): the max (for stability), the target
logit (found on exactly one rank) and the sum of exponentials.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _reduce(x: torch.Tensor, op: dist.ReduceOp, group: ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        logits = logits.float()
        per_rank = logits.shape[-1]
        start = dist.get_rank(group) * per_rank

        logits_max = _reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)

        local = target - start
        outside = (local < 0) | (local >= per_rank)
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = _reduce(target_logit, dist.ReduceOp.SUM, group)

        exp = shifted.exp()
        sum_exp = _reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, outside = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target); the onehot lives on one rank only.
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                                 group: ProcessGroup) -> torch.Tensor:
    """Per-token loss (B, S) from vocab-sharded logits (B, S, V/tp) and global target ids (B, S)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
