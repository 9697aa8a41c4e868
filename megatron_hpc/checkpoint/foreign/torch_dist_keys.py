"""megatron-core's torch_dist keys to our GPT's names and back, on whole (global) tensors. Pure: dicts in, dicts out.

torch_dist stores a GPTModel by megatron-core's sharded_state_dict keys (megatron-core 0.16.1 models/gpt/gpt_model.py,
transformer/transformer_block.py and transformer_layer.py; what the fixtures in tests/fixtures/megatron_core_torch_dist
hold). Every decoder layer's tensor is stacked on a leading layer axis over all pipeline stages, and the layer norms
carry Transformer Engine's fused names whichever layer spec trained the model (the local spec maps input_layernorm
and pre_mlp_layernorm onto them when it saves):

    megatron-core (torch_dist)                                     ours (layer N of the stack)
    embedding.word_embeddings.weight                               wte.weight
    embedding.position_embeddings.weight                           wpe.weight
    decoder.layers.self_attention.linear_qkv.layer_norm_{weight,bias} h.N.ln_1.*   (also input_layernorm.*)
    decoder.layers.self_attention.linear_qkv.{weight,bias}         h.N.attn.qkv.*
    decoder.layers.self_attention.linear_proj.{weight,bias}        h.N.attn.proj.*
    decoder.layers.mlp.linear_fc1.layer_norm_{weight,bias}         h.N.ln_2.*      (also pre_mlp_layernorm.*)
    decoder.layers.mlp.linear_fc1.{weight,bias}                    h.N.mlp.fc.*, or with SwiGLU [gate; up] rows:
                                                                   h.N.mlp.gate.* and h.N.mlp.fc.*
    decoder.layers.mlp.linear_fc2.{weight,bias}                    h.N.mlp.proj.*
    decoder.final_layernorm.{weight,bias}                          ln_f.*
    output_layer.weight (untied only: a tied one is saved under the embedding's key)  lm_head.weight

QKV rows are megatron-core's grouped layout [G, (nh/G queries, key, value), hd], ours too. The TP shards of a
column-parallel weight are consecutive row blocks of the global tensor, so linear_qkv is whole groups in order.
SwiGLU's linear_fc1 holds [gate_r; up_r] on TP rank r, but its sharded_state_dict (mlp.py
apply_swiglu_sharded_factory) saves the gate halves of all ranks first and the up halves after: the global tensor is
[gate; up] at any TP. The optimizer's model-space state is under `optimizer.state.<what>.<model key>`, shaped like it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron_hpc.errors import CheckpointError

_LAYERS = "decoder.layers."
_STACKED = {  # the part after decoder.layers. -> our name after h.N.
    "self_attention.linear_qkv.layer_norm_weight": "ln_1.weight",
    "self_attention.linear_qkv.layer_norm_bias": "ln_1.bias",
    "input_layernorm.weight": "ln_1.weight",
    "input_layernorm.bias": "ln_1.bias",
    "self_attention.linear_qkv.weight": "attn.qkv.weight",
    "self_attention.linear_qkv.bias": "attn.qkv.bias",
    "self_attention.linear_proj.weight": "attn.proj.weight",
    "self_attention.linear_proj.bias": "attn.proj.bias",
    "mlp.linear_fc1.layer_norm_weight": "ln_2.weight",
    "mlp.linear_fc1.layer_norm_bias": "ln_2.bias",
    "pre_mlp_layernorm.weight": "ln_2.weight",
    "pre_mlp_layernorm.bias": "ln_2.bias",
    "mlp.linear_fc1.weight": "mlp.fc.weight",
    "mlp.linear_fc1.bias": "mlp.fc.bias",
    "mlp.linear_fc2.weight": "mlp.proj.weight",
    "mlp.linear_fc2.bias": "mlp.proj.bias",
}
_SINGLE = {
    "embedding.word_embeddings.weight": "wte.weight",
    "embedding.position_embeddings.weight": "wpe.weight",
    "decoder.final_layernorm.weight": "ln_f.weight",
    "decoder.final_layernorm.bias": "ln_f.bias",
    "output_layer.weight": "lm_head.weight",
}
# What export writes: Transformer Engine's fused norm names, which megatron-core's local spec loads too.
_EXPORT_STACKED = {ours: key for key, ours in _STACKED.items()
                   if not key.startswith(("input_layernorm", "pre_mlp_layernorm"))}
_EXPORT_SINGLE = {ours: key for key, ours in _SINGLE.items()}
_SKIPPED = re.compile(r".*(?:_extra_state(?:/shard_.*)?|\.inv_freq)$")
_OPTIMIZER = re.compile(r"^optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.+)$")
_OUR_LAYER = re.compile(r"^h\.(\d+)\.(.+)$")


def is_model_key(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng_state")) and not _SKIPPED.match(key)


def optimizer_key(key: str) -> tuple[str, str] | None:
    """(what: exp_avg | exp_avg_sq | fp32_param | param, model key) of a model-space optimizer key, else None."""
    match = _OPTIMIZER.match(key)
    return (match.group(1), match.group(2)) if match else None


def check_known(key: str) -> None:
    """CheckpointError naming a model key our GPT has no place for (MoE experts, QK norms, MTP layers, ...)."""
    if key in _SINGLE or (key.startswith(_LAYERS) and key[len(_LAYERS):] in _STACKED):
        return
    raise CheckpointError(f"the checkpoint's weight {key} has no counterpart in our GPT (dense GPT and Llama-style "
                          "layers: LayerNorm or RMSNorm, GeLU or SwiGLU MLP, multi-head or grouped-query attention, "
                          "no QK norms or experts); its architecture cannot be converted")


def to_ours(key: str, tensor: torch.Tensor, *, swiglu: bool, num_layers: int) -> dict[str, torch.Tensor]:
    """Our tensors of one model key (a stacked key gives one per layer; SwiGLU's linear_fc1 two per layer)."""
    check_known(key)
    if key in _SINGLE:
        return {_SINGLE[key]: tensor}
    rest = key[len(_LAYERS):]
    if tensor.ndim < 2 or tensor.shape[0] != num_layers:
        raise CheckpointError(f"{key} is {tuple(tensor.shape)}, not stacked over the {num_layers} layers the "
                              "checkpoint has; it was not written by megatron-core's GPT, it cannot be converted")
    ours = _STACKED[rest]
    out: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        layer = tensor[i]
        if swiglu and rest.startswith("mlp.linear_fc1.") and ours.startswith("mlp.fc."):
            if layer.shape[0] % 2:
                raise CheckpointError(f"{key} has {layer.shape[0]} rows per layer, not [gate; up] halves; the "
                                      "checkpoint's swiglu argument does not fit its weights")
            gate, up = layer.chunk(2, dim=0)
            out[f"h.{i}.{ours.replace('fc', 'gate', 1)}"] = gate
            out[f"h.{i}.{ours}"] = up
        else:
            # A vector (norm, bias) is copied out of the stack: a writer saving the view would save the whole
            # stack's storage, once per layer. Matrices are copied as they are split (stream.reshard).
            out[f"h.{i}.{ours}"] = layer.clone() if layer.ndim == 1 else layer
    return out


def to_megatron(model: dict[str, torch.Tensor], *, tied: bool) -> dict[str, torch.Tensor]:
    """megatron-core's torch_dist tensors (stacked over layers, fused names, SwiGLU [gate; up]) of our whole model.

    A tied model has no output_layer key: megatron-core saves the output layer under the embedding's key."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in model.items():
        match = _OUR_LAYER.match(name)
        if match is None:
            if name not in _EXPORT_SINGLE or (tied and name == "lm_head.weight"):
                raise CheckpointError(f"our weight {name} has no place in megatron-core's GPT; the checkpoint "
                                      "cannot be written as torch_dist")
            out[_EXPORT_SINGLE[name]] = tensor
            continue
        layers.setdefault(match.group(2), {})[int(match.group(1))] = tensor
    count = 1 + max((i for per in layers.values() for i in per), default=-1)
    gates = layers.pop("mlp.gate.weight", None), layers.pop("mlp.gate.bias", None)
    for rest, per in layers.items():
        if rest not in _EXPORT_STACKED or sorted(per) != list(range(count)):
            raise CheckpointError(f"our weight h.N.{rest} has no place in megatron-core's GPT, or not every layer "
                                  "has it; the checkpoint cannot be written as torch_dist")
        gate = gates[0] if rest == "mlp.fc.weight" else gates[1] if rest == "mlp.fc.bias" else None
        stacked = [per[i] if gate is None else torch.cat([gate[i], per[i]]) for i in range(count)]
        out[_LAYERS + _EXPORT_STACKED[rest]] = torch.stack(stacked)
    return out


def layer_slots(key: str) -> str | None:
    """The part of a stacked key after decoder.layers. (None for a key of no layer)."""
    return key[len(_LAYERS):] if key.startswith(_LAYERS) else None


def tp_split_dim(key: str) -> int | None:
    """The dim megatron-core splits a model key's per-layer tensor on over TP (None: replicated)."""
    rest = layer_slots(key) or key
    if rest in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if rest.startswith(("self_attention.linear_qkv.", "mlp.linear_fc1.")) and "layer_norm" not in rest:
        return 0
    if rest in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return 1
    return None


def describe(keys: list[str]) -> dict[str, Any]:
    """Which model keys are present, for architecture checks: {'has_bias', 'has_position', 'untied', ...}."""
    return {"linear_bias": any(k.endswith(("linear_proj.bias", "linear_fc2.bias")) for k in keys),
            "qkv_bias": any(k.endswith("linear_qkv.bias") for k in keys),
            "position": "embedding.position_embeddings.weight" in keys,
            "output_layer": "output_layer.weight" in keys,
            "norm_bias": any(k.endswith(("layer_norm_bias", "final_layernorm.bias", "layernorm.bias")) for k in keys)}
