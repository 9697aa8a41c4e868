"""Forward passes that score evaluation inputs with a whole (TP 1) GPT, as Megatron's evaluation does: the
cross entropy over the model's padded vocabulary, the argmax over it for the cloze task.

Rows of a batch are padded at the end to the longest row; the model is causal, so a padded position never
changes the logits of an earlier one, and padded targets are never scored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hpc.evaluate.tasks import ClozeExample, Window

PAD_ID = 0
"""Any valid id does: a padded position is after every scored one (causal attention) and is never scored."""


def _padded(rows: Sequence[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long)


def _chunks(items: Sequence, size: int) -> Iterable[Sequence]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def token_losses(model: nn.Module, rows: Sequence[list[int]]) -> torch.Tensor:
    """Per-target cross entropy (B, W - 1) of each row predicting its own next tokens (W: longest row)."""
    tokens = _padded(rows)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).float()  # (B, W-1, V_padded)
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view(len(rows), -1)


def sample_losses(model: nn.Module, samples: torch.Tensor, *, batch_size: int) -> torch.Tensor:
    """Mean token loss of each (seq_length + 1)-token sample, as the training loss reads it, in float64."""
    means = [token_losses(model, chunk.tolist()).double().mean(dim=1) for chunk in samples.split(batch_size)]
    return torch.cat(means)


def windowed_loss_sum(model: nn.Module, tokens: list[int], windows: Sequence[Window], *,
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


def cloze_hits(model: nn.Module, examples: Sequence[ClozeExample], *, batch_size: int) -> list[bool]:
    """Whether the greedy prediction at every target position equals the target token (all of them)."""
    hits = []
    for chunk in _chunks(examples, batch_size):
        tokens = _padded([e.context + e.target for e in chunk])
        with torch.no_grad():
            predicted = model(tokens[:, :-1]).argmax(dim=-1)  # (B, W-1)
        for row, e in zip(predicted, chunk):
            first = len(e.context) - 1  # the position whose next token is the target's first
            hits.append(row[first:first + len(e.target)].tolist() == e.target)
    return hits
