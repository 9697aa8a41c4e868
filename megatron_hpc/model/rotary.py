"""Rotary position embeddings (RoPE), with partial rotation as in GPT-NeoX / Pythia.

Megatron's RotaryEmbedding and apply_rotary_pos_emb (non-interleaved): the first
rot = int(head_dim * rotary_percent) dims of each head are rotated, the rest pass through.
Within the rotated part, dim i pairs with dim i + rot/2 and turns by position * base^(-2i/rot)
(the "rotate_half" layout). Tables are built for max_position_embeddings once, in fp32. This is also GPT-NeoX's and
HF GPTNeoX's rotation (rotary_pct, rotary_emb_base = our rotary_percent, model.rotary_base): the logits of
transformers' GPTNeoXForCausalLM are matched in tests/unit/test_checkpoint_hf_neox.py.
Not ported: the Neuron NeMo fork's full-width rotary (aws-neuron/neuronx-nemo-megatron, rotary_pos_embedding.py: tables
[freqs, freqs, zeros] over the whole head, rotate_half over the whole head). Below a full rotation it pairs dim i with
i + hd/2 instead of i + rot/2 and turns some dims against unrotated ones, so it is another model, not this rotation.

Shape legend: B batch, nh heads (local to the TP rank), S sequence, hd head dim, rot rotated dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.plan.model_math import rotary_dims  # noqa: F401  (pure; the model and the planner share it)

ROTARY_BASE = 10000.0
"""Megatron's --rotary-base default."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Llama3Scaling:
    """Llama 3.1's frequency scaling (model.rope_scaling=llama3; the fields are the model's rope_* keys)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def scaling_of(cfg: ModelConfig) -> Llama3Scaling | None:
    if cfg.rope_scaling == "none":
        return None
    return Llama3Scaling(factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_low_freq_factor,
                         high_freq_factor=cfg.rope_high_freq_factor,
                         original_max_position=cfg.rope_original_max_position)


def scale_frequencies(inv_freq: torch.Tensor, scaling: Llama3Scaling) -> torch.Tensor:
    """Llama 3.1's rule: a frequency whose wavelength is longer than original / low_freq_factor turns `factor` times
    slower; one shorter than original / high_freq_factor is kept; between the two, the result moves linearly (in
    original / wavelength) from the slowed one to the kept one."""
    wavelength = 2 * math.pi / inv_freq
    ratio = scaling.original_max_position / wavelength  # how many wavelengths fit the original context
    lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
    blend = ((ratio - lo) / (hi - lo)).clamp(0.0, 1.0)  # 0: long wavelengths (slowed), 1: short ones (kept)
    return inv_freq / scaling.factor * (1.0 - blend) + inv_freq * blend


def rotary_tables(rot: int, *, max_positions: int, base: float = ROTARY_BASE,
                  scaling: Llama3Scaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (max_positions, rot) fp32, laid out [freqs, freqs] to match rotate_half."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))  # (rot/2,)
    if scaling is not None:
        inv_freq = scale_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)  # (P, rot/2)
    angles = torch.cat([angles, angles], dim=-1)  # (P, rot)
    return angles.cos().float(), angles.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x (B, nh, S, hd) by the tables' first S rows."""
    s = x.shape[-2]
    return rotate(x, cos[:s], sin[:s])  # (S, rot), broadcast over B and nh


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x (B, nh, S, hd) by tables that broadcast against it: (S, rot) for
    shared positions, (B, 1, S, rot) for per-row positions (generation with left-padded prompts)."""
    rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)
