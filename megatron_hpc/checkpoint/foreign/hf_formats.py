"""Which Hugging Face architectures `ckpt convert` reads and writes: the `architectures` name of config.json -> the
module that maps it to our GPT.

Each module is pure and has the same four functions (hf_gpt2.py is the model):
- `model_config_from_hf(config: dict) -> dict`: our ModelConfig keys from config.json (CheckpointError when our
  GPT cannot run it);
- `hf_config_from_model(model: dict, *, eos_token_id: int | None = None) -> dict`: config.json from our model
  config (CheckpointError, saying what the architecture cannot express, when it cannot);
- `state_from_hf(hf: dict[str, Tensor], model: dict) -> dict[str, Tensor]`: our whole unsharded weights (fp32, the
  vocabulary not padded) from the HF state dict;
- `state_to_hf(full: dict[str, Tensor], model: dict) -> dict[str, Tensor]`: the HF state dict from ours.
Optional: `TOKENIZER_JSON_FIRST = True` when the folder's tokenizer.json wins over a vocab.json and merges.txt
beside it (hf_import.data_config).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from megatron_hpc.errors import CheckpointError

# config.json architecture -> module. Export tries them in this order and writes the first that can express the model.
MODULES = {
    "GPT2LMHeadModel": "megatron_hpc.checkpoint.foreign.hf_gpt2",
    "GPTNeoXForCausalLM": "megatron_hpc.checkpoint.foreign.hf_neox",
    "LlamaForCausalLM": "megatron_hpc.checkpoint.foreign.hf_llama",
    "Qwen2ForCausalLM": "megatron_hpc.checkpoint.foreign.hf_qwen2",
    "MistralForCausalLM": "megatron_hpc.checkpoint.foreign.hf_mistral",
}
# config.json without `architectures` (hand-written ones): model_type -> architecture.
MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# Architectures people bring that our GPT cannot run, and what it lacks for them (the refusal names it).
CANNOT = {
    "MixtralForCausalLM": "mixture-of-experts MLPs",
    "Qwen2MoeForCausalLM": "mixture-of-experts MLPs",
    "Qwen3MoeForCausalLM": "mixture-of-experts MLPs",
    "DeepseekV3ForCausalLM": "mixture-of-experts MLPs and multi-head latent attention",
    "GemmaForCausalLM": "GeGLU MLPs, (1 + weight) RMSNorms and a scaled embedding",
    "Gemma2ForCausalLM": "attention and final-logit soft-capping and sliding-window layers",
    "Gemma3ForCausalLM": "sliding-window layers and RMSNorms on queries and keys",
    "Qwen3ForCausalLM": "RMSNorms on queries and keys",
}


@dataclass(frozen=True, slots=True)
class HfFormat:
    architecture: str
    module: ModuleType

    def model_config_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        return self.module.model_config_from_hf(config)

    def hf_config_from_model(self, model: dict[str, Any], *, eos_token_id: int | None = None) -> dict[str, Any]:
        return self.module.hf_config_from_model(model, eos_token_id=eos_token_id)

    def state_from_hf(self, hf: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
        return self.module.state_from_hf(hf, model)

    def state_to_hf(self, full: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
        return self.module.state_to_hf(full, model)

    @property
    def tokenizer_json_first(self) -> bool:
        return bool(getattr(self.module, "TOKENIZER_JSON_FIRST", False))


def _load(architecture: str) -> HfFormat:
    return HfFormat(architecture, importlib.import_module(MODULES[architecture]))


def available() -> list[HfFormat]:
    """Every format, in MODULES' order (export's order of preference)."""
    return [_load(name) for name in MODULES]


def supported() -> list[str]:
    return [f.architecture for f in available()]


def for_config(config: dict[str, Any], *, where: object) -> HfFormat:
    """The format of a config.json; CheckpointError naming its architecture and the supported ones."""
    names = config.get("architectures")
    if not names and config.get("model_type") in MODEL_TYPES:
        names = [MODEL_TYPES[config["model_type"]]]
    if not isinstance(names, list) or not names:
        raise CheckpointError(f"{where} names no architectures (nor a known model_type); supported: "
                              f"{', '.join(supported())}")
    if names[0] not in MODULES:
        lacks = f" ({CANNOT[names[0]]}, which our GPT does not have)" if names[0] in CANNOT else ""
        raise CheckpointError(f"{where} is a {names[0]}{lacks}, which megatron-hpc does not import; supported: "
                              f"{', '.join(supported())}")
    return _load(names[0])


def for_model(model: dict[str, Any], *, eos_token_id: int | None = None, where: object,
              prefer: str | None = None) -> tuple[HfFormat, dict[str, Any]]:
    """The first format that can express our model config (`prefer`, the architecture it was imported as, before
    the others), with its config.json; CheckpointError with each format's reason when none can."""
    reasons = []
    formats = sorted(available(), key=lambda f: f.architecture != prefer)  # stable: the rest keep MODULES' order
    for fmt in formats:
        try:
            return fmt, fmt.hf_config_from_model(model, eos_token_id=eos_token_id)
        except CheckpointError as exc:
            reasons.append(f"not a {fmt.architecture}: {exc}")
    raise CheckpointError(f"{where} cannot be exported to Hugging Face ({'; '.join(reasons)}); keep it in "
                          "Megatron's format")
