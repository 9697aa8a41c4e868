"""Cross entropy over vocabulary-sharded logits, without ever gathering the full logits.

Each TP rank holds logits (B, S, V/tp) for a contiguous slice of the padded vocabulary. The
passes over the logits are what cost time on a CPU (a (B, S, V) tensor does not fit in cache), so
the forward makes one fused pass (`log_softmax`, which keeps each row in cache while it finds the
max, sums the exponentials and writes the normalised row) and the backward turns the saved local
log-probabilities into the gradient in place (exp, then one multiply). With tp > 1 two all-reduces
of (B, S) tensors replace a gather of (B, S, V): the max of the ranks' log-sum-exps, then the sum of
their rescaled exponentials stacked with the target logit (found on exactly one rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        logits = logits.float()
        per_rank = logits.shape[-1]
        tp = dist.get_world_size(group)
        local = target - dist.get_rank(group) * per_rank
        outside = (local < 0) | (local >= per_rank)
        local = local.masked_fill(outside, 0).unsqueeze(-1)  # (B, S, 1)
        log_probs = torch.log_softmax(logits, dim=-1)  # (B, S, V/tp), normalised over this rank's slice
        target_log_prob = log_probs.gather(-1, local).squeeze(-1)  # (B, S)
        if tp == 1:
            ctx.save_for_backward(log_probs, local, outside)
            ctx.shift = None
            return -target_log_prob
        # This slice's log-sum-exp, read off the row max: lse = max(x) - max(log_probs), exact to
        # rounding because max(log_probs) is small (between -log(V/tp) and 0).
        local_lse = logits.amax(dim=-1) - log_probs.amax(dim=-1)  # (B, S)
        top = local_lse.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        target_logit = (target_log_prob + local_lse).masked_fill(outside, 0.0)
        sums = torch.stack([(local_lse - top).exp(), target_logit])  # (2, B, S)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = top + sums[0].log()  # log-sum-exp over the whole vocabulary
        # The saved log-probabilities are per slice; the global ones are shifted by this much.
        ctx.shift = (lse - local_lse).unsqueeze(-1)  # (B, S, 1)
        ctx.save_for_backward(log_probs, local, outside)
        return lse - sums[1]

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        log_probs, local, outside = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target); the onehot lives on one rank only. The saved
        # tensor becomes the gradient in place, as in Megatron: a second backward through this graph
        # raises autograd's in-place error instead of reading a clobbered tensor.
        grad = log_probs if ctx.shift is None else log_probs.sub_(ctx.shift)
        grad.exp_()
        grad.scatter_add_(-1, local, -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                                 group: ProcessGroup) -> torch.Tensor:
    """Per-token loss (B, S) from vocab-sharded logits (B, S, V/tp) and global target ids (B, S)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
