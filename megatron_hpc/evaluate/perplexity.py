"""Megatron's perplexity of a mean token loss, one formula for every figure we print: the trainer's validation
block and metrics.jsonl rows, `megatron-hpc evaluate`'s split losses and the zero-shot tasks' token and word PPL.

It lives here, below train/, so that the evaluation tools and the trainer share it without evaluate/ reaching
into train/. No torch: train/metrics.py and the CLI import it cheaply.
"""

from __future__ import annotations

import math


def capped_ppl(lm_loss: float) -> float:
    """exp(min(20, loss)), as Megatron caps it so that a diverged loss still prints a number; NaN stays NaN."""
    return math.exp(min(20.0, lm_loss)) if not math.isnan(lm_loss) else math.nan
