"""megatron-core's local-spec GPT parameter names -> ours, for the tests that check imports of checkpoints written by
the real megatron-core (legacy and torch_dist alike). Written out here rather than taken from the code under test.
SwiGLU's linear_fc1 is our gate and fc together: the summaries (sums of values, of |values|, of squares) of the two
add up to the fused tensor's."""

from __future__ import annotations

import re

import torch

_NAMES = [(r"embedding\.word_embeddings\.(\w+)", [r"wte.\1"]),
          (r"embedding\.position_embeddings\.(\w+)", [r"wpe.\1"]), (r"output_layer\.weight", ["lm_head.weight"]),
          (r"decoder\.layers\.(\d+)\.input_layernorm\.(\w+)", [r"h.\1.ln_1.\2"]),
          (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.(\w+)", [r"h.\1.attn.qkv.\2"]),
          (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.(\w+)", [r"h.\1.attn.proj.\2"]),
          (r"decoder\.layers\.(\d+)\.pre_mlp_layernorm\.(\w+)", [r"h.\1.ln_2.\2"]),
          (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.(\w+)", [r"h.\1.mlp.fc.\2", r"h.\1.mlp.gate.\2"]),
          (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2\.(\w+)", [r"h.\1.mlp.proj.\2"]),
          (r"decoder\.final_layernorm\.(\w+)", [r"ln_f.\1"])]


def ours_names(name: str, model: dict[str, torch.Tensor]) -> list[str]:
    """Our names of megatron-core's parameter `name` (two for SwiGLU's fused linear_fc1) that `model` has."""
    for pattern, replacements in _NAMES:
        if re.fullmatch(pattern, name):
            return [n for n in (re.sub(pattern, r, name) for r in replacements) if n in model]
    raise AssertionError(f"no mapping for {name}")
