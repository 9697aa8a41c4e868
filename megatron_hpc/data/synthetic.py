"""Deterministic synthetic tokens (data.source: synthetic), like Megatron's --mock-data.

Sample i is an arithmetic progression modulo min(vocab_size, PERIOD) whose start and stride are
drawn from a generator seeded by (seed, i) alone. So a sample does not depend on the mesh, on which
rank reads it, or on what was read before; and the rule is learnable, so the loss visibly falls
within a few steps.

Which samples a rank reads in which step is the plan's BatchLayout (plan/batch.py), for every token source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

STRIDES = (1, 2, 3, 5)
"""Strides of the progressions."""
PERIOD = 32
"""Progressions run modulo min(vocab_size, PERIOD): few enough distinct tokens that a tiny model learns
the rule within ~20 steps, while the model still predicts over the whole vocabulary."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticTokens:
    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    seq_length: int
    """Model sequence length; each sample holds seq_length + 1 tokens (inputs and shifted labels)."""
    seed: int
    """Data seed; with the sample index it fixes the sample."""

    def sample(self, index: int) -> np.ndarray:
        """Tokens of global sample `index`, shape (seq_length + 1,), int64."""
        if index < 0:
            raise ValueError(f"sample index must be >= 0, got {index}")
        rng = np.random.default_rng((self.seed, index))
        period = min(self.vocab_size, PERIOD)
        start = int(rng.integers(period))
        stride = STRIDES[int(rng.integers(len(STRIDES)))]
        return (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % period

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        """Samples stacked to (len(indices), seq_length + 1), int64, on the CPU."""
        return torch.from_numpy(np.stack([self.sample(i) for i in indices]))
