"""Mistral (Hugging Face `MistralForCausalLM`) <-> our GPT: Llama's mapping (hf_llama.py), no biases. Its sliding-window
attention is refused: transformers' MistralConfig defaults sliding_window to 4096, so only a config.json that sets it
to null (Mistral 7B v0.3's) is full attention, and that one is exactly Llama's architecture. Pure."""

from __future__ import annotations

from typing import Any

import torch

from megatron_hpc.checkpoint.foreign.hf_llama import MISTRAL, config_from_hf, config_to_hf, state_from
from megatron_hpc.checkpoint.foreign.hf_llama import TOKENIZER_JSON_FIRST as TOKENIZER_JSON_FIRST
from megatron_hpc.checkpoint.foreign.hf_llama import state_to_hf as state_to_hf  # the same names both ways

ARCHITECTURE = MISTRAL


def model_config_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    return config_from_hf(cfg, name=ARCHITECTURE, qkv_bias=False)


def hf_config_from_model(model: dict[str, Any], *, eos_token_id: int | None = None) -> dict[str, Any]:
    return config_to_hf(model, name=ARCHITECTURE, model_type="mistral", qkv_bias=False, eos_token_id=eos_token_id)


def state_from_hf(sd: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    return state_from(sd, model, name=ARCHITECTURE)
