"""Qwen2 / Qwen2.5 (Hugging Face `Qwen2ForCausalLM`) <-> our GPT: Llama's mapping (hf_llama.py) with a bias on the
q, k and v projections (our model.add_qkv_bias) and no other. A sliding window that some layer attends through is
refused; use_sliding_window on no layer (max_window_layers = num_hidden_layers) is full attention (hf_llama.py
_sliding_window). Pure."""

from __future__ import annotations

from typing import Any

import torch

from megatron_hpc.checkpoint.foreign.hf_llama import TOKENIZER_JSON_FIRST as TOKENIZER_JSON_FIRST
from megatron_hpc.checkpoint.foreign.hf_llama import config_from_hf, config_to_hf, state_from
from megatron_hpc.checkpoint.foreign.hf_llama import state_to_hf as state_to_hf  # the same names both ways

ARCHITECTURE = "Qwen2ForCausalLM"


def model_config_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    return config_from_hf(cfg, name=ARCHITECTURE, qkv_bias=True)


def hf_config_from_model(model: dict[str, Any], *, eos_token_id: int | None = None) -> dict[str, Any]:
    return config_to_hf(model, name=ARCHITECTURE, model_type="qwen2", qkv_bias=True, eos_token_id=eos_token_id)


def state_from_hf(sd: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    return state_from(sd, model, name=ARCHITECTURE)
