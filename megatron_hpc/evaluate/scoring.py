"""Forward passes that score evaluation inputs with a GPT at any TP size, or with the pipeline stages of a
PipelinedScorer, as Megatron's evaluation does: the vocab-parallel cross entropy over the model's padded
vocabulary, the argmax over it for the cloze task. Every rank passes the same inputs and gets the same figures.

Rows of a batch are padded at the end to the longest row; the model is causal, so a padded position never
changes the logits of an earlier one, and padded targets are never scored.

The inputs go to the model's device (CPU, CUDA or XLA) and the figures come back to the CPU, where they are summed
in float64 (which XLA devices may lack). On XLA each distinct batch shape compiles one graph: the split losses have
one shape (plus a smaller last batch); the zero-shot tasks one per distinct longest row of a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_hpc.evaluate.pipelined import PipelinedScorer
from megatron_hpc.evaluate.tasks import ClozeExample, Window
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy

PAD_ID = 0
"""Any valid id does: a padded position is after every scored one (causal attention) and is never scored."""


def _padded(rows: Sequence[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long)


def _chunks(items: Sequence, size: int) -> Iterable[Sequence]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


Scorer = GPT | PipelinedScorer


def _device(model: Scorer) -> torch.device:
    """Where the inputs go: the model's device; a pipeline's stages run on the CPU (gloo)."""
    return torch.device("cpu") if isinstance(model, PipelinedScorer) else model.ln_f.weight.device


def _per_position(model: Scorer, inputs: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor], *,
                  dtype: torch.dtype) -> torch.Tensor:
    """reduce(logits (B, W, V/tp)) -> (B, W) for the input ids (B, W), on every rank, back on the CPU."""
    if isinstance(model, PipelinedScorer):
        return model.apply(inputs, reduce, dtype=dtype)
    with torch.no_grad():
        return reduce(model(inputs)).to(dtype).cpu()


def token_losses(model: Scorer, rows: Sequence[list[int]]) -> torch.Tensor:
    """Per-target cross entropy (B, W - 1) of each row predicting its own next tokens (W: longest row)."""
    tokens = _padded(rows).to(_device(model))
    targets = tokens[:, 1:]
    return _per_position(model, tokens[:, :-1], lambda logits: vocab_parallel_cross_entropy(
        logits.float(), targets, group=model.group), dtype=torch.float32)


def global_argmax(logits: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """Argmax ids (...) over the whole padded vocabulary from vocab-sharded logits (..., V/tp); on a tie the lowest
    id wins, as torch.argmax on the gathered logits."""
    best, ids = logits.max(dim=-1)
    size = dist.get_world_size(group)
    if size == 1:
        return ids
    ids = ids + dist.get_rank(group) * logits.shape[-1]
    values, indices = [torch.empty_like(best) for _ in range(size)], [torch.empty_like(ids) for _ in range(size)]
    dist.all_gather(values, best.contiguous(), group=group)
    dist.all_gather(indices, ids.contiguous(), group=group)
    owner = torch.stack(values).argmax(dim=0, keepdim=True)  # the first shard holding the maximum
    return torch.stack(indices).gather(0, owner).squeeze(0)


def sample_losses(model: Scorer, samples: torch.Tensor, *, batch_size: int) -> torch.Tensor:
    """Mean token loss of each (seq_length + 1)-token sample, as the training loss reads it, in float64."""
    means = [token_losses(model, chunk.tolist()).double().mean(dim=1) for chunk in samples.split(batch_size)]
    return torch.cat(means)


def windowed_loss_sum(model: Scorer, tokens: list[int], windows: Sequence[Window], *,
                      batch_size: int) -> tuple[float, int]:
    """Sum of the loss over every scored target of `windows`, and their count (Megatron's _LMDataset)."""
    total, scored = 0.0, 0
    for chunk in _chunks(windows, batch_size):
        losses = token_losses(model, [tokens[w.start:w.stop] for w in chunk]).double()
        for row, w in zip(losses, chunk):
            num_targets = w.stop - w.start - 1
            total += float(row[w.first_scored:num_targets].sum())
            scored += max(num_targets - w.first_scored, 0)
    return total, scored


def cloze_hits(model: Scorer, examples: Sequence[ClozeExample], *, batch_size: int) -> list[bool]:
    """Whether the greedy prediction at every target position equals the target token (all of them)."""
    hits = []
    for chunk in _chunks(examples, batch_size):
        tokens = _padded([e.context + e.target for e in chunk]).to(_device(model))
        predicted = _per_position(model, tokens[:, :-1], lambda logits: global_argmax(logits, group=model.group),
                                  dtype=torch.long)  # (B, W-1)
        for row, e in zip(predicted, chunk):
            first = len(e.context) - 1  # the position whose next token is the target's first
            hits.append(row[first:first + len(e.target)].tolist() == e.target)
    return hits
