"""Hugging Face GPT2LMHeadModel <-> our GPT, both directions. Pure: dicts of config values and tensors in and out.

Mapping (megatron-and-launchers.md 3.5): the word embeddings without the padding rows are `transformer.wte` (tied
to `lm_head` unless tie_word_embeddings is false), learned positions `transformer.wpe`; each block's LayerNorms map
one to one. HF's GPT-2 uses Conv1D ([in, out]) weights, so every linear is transposed, and its fused QKV columns
are [q (all heads) | k | v] where ours are Megatron's per-head rows [heads, (q, k, v), head dim] (a TP row block
then holds whole heads). GPT-2 was trained with the tanh GeLU (HF's `gelu_new`): model.activation=gelu_tanh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import CheckpointError

ARCHITECTURE = "GPT2LMHeadModel"

# HF activation_function -> model.activation. gelu_new, gelu_pytorch_tanh and gelu_fast are the same tanh formula.
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
_TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
# HF GPT-2 switches our GPT does not follow: (key, the value we can express, what it means).
_UNSUPPORTED = (("scale_attn_weights", True, "attention without 1/sqrt(head dim) scaling"),
                ("scale_attn_by_inverse_layer_idx", False, "attention scaled by 1/layer index"),
                ("add_cross_attention", False, "cross-attention layers"))
# ModelConfig fields that do not change what GPT2LMHeadModel computes (training or memory settings only; the rotary
# ones matter only with rotary positions, which GPT-2 refuses anyway).
_NO_EFFECT = {"seq_length", "make_vocab_size_divisible_by", "init_method_std", "attention_dropout", "hidden_dropout",
              "recompute", "recompute_granularity", "recompute_method", "recompute_num_layers", "rotary_percent",
              "rotary_base"}
_EXPRESSED = {"num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "vocab_size",
              "ffn_hidden_size", "position_embedding", "tie_embeddings", "layernorm_epsilon", "activation"}
# Buffers older transformers versions saved with the weights (the causal mask), not weights.
_BUFFERS = (".attn.bias", ".attn.masked_bias")
_LINEARS = (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj"))


def model_config_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """Our model config (ModelConfig keys) of a GPT2LMHeadModel config.json; CheckpointError for what we cannot run."""
    for key, ours, what in _UNSUPPORTED:
        if config.get(key, ours) != ours:
            raise CheckpointError(f"config.json sets {key}={config[key]!r} ({what}), which our GPT does not have; "
                                  "this GPT-2 variant cannot be imported")
    act = config.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"config.json's activation_function {act!r} is not a GeLU our MLP has; supported: "
                              f"{', '.join(sorted(_ACTIVATIONS))}")
    try:
        hidden, heads, layers = int(config["n_embd"]), int(config["n_head"]), int(config["n_layer"])
        positions, vocab = int(config["n_positions"]), int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json has no usable {exc} for a GPT2LMHeadModel; pass the folder "
                              "save_pretrained wrote") from None
    if hidden % heads:
        raise CheckpointError(f"config.json: n_embd {hidden} is not a multiple of n_head {heads}")
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "seq_length": positions, "max_position_embeddings": positions, "vocab_size": vocab,
            "ffn_hidden_size": int(config.get("n_inner") or 4 * hidden),
            "position_embedding": "learned", "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
            "init_method_std": float(config.get("initializer_range", 0.02)),
            "layernorm_epsilon": float(config.get("layer_norm_epsilon", 1e-5)),
            "activation": _ACTIVATIONS[act]}


def blockers(model: dict[str, Any]) -> list[str]:
    """What GPT2LMHeadModel cannot express about our model config (empty when it can)."""
    found = []
    if model.get("position_embedding", "learned") != "learned":
        found.append("rotary position embeddings (GPT-2 has learned positions)")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    # Any other architecture setting (added after this module) must be at its default for GPT-2 to compute the same.
    for key, value in model.items():
        if key not in _EXPRESSED | _NO_EFFECT and key in defaults and value != defaults[key]:
            found.append(f"model.{key}={value!r}")
    return found


def hf_config_from_model(model: dict[str, Any], *, eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json of our model as a GPT2LMHeadModel; CheckpointError when GPT-2 cannot express it.

    `eos_token_id`: the tokenizer's <|endoftext|> id; without a tokenizer, the last id (where GPT-2 style
    vocabularies keep it)."""
    found = blockers(model)
    if found:
        raise CheckpointError(f"it uses {' and '.join(found)}")
    h = model["hidden_size"]
    eos = model["vocab_size"] - 1 if eos_token_id is None else eos_token_id
    return {
        "architectures": [ARCHITECTURE], "model_type": "gpt2",
        "vocab_size": model["vocab_size"], "n_positions": model["max_position_embeddings"],
        "n_embd": h, "n_layer": model["num_layers"], "n_head": model["num_attention_heads"],
        "n_inner": model.get("ffn_hidden_size") or 4 * h,
        "activation_function": _TO_HF_ACTIVATION[model.get("activation", "gelu")],
        "layer_norm_epsilon": model.get("layernorm_epsilon", 1e-5),
        "initializer_range": model.get("init_method_std", 0.02),
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "tie_word_embeddings": bool(model.get("tie_embeddings", True)), "bos_token_id": eos, "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def _qkv_to_hf(t: torch.Tensor, *, heads: int) -> torch.Tensor:
    """[heads, (q, k, v), hd] rows -> [q (all heads) | k | v] rows."""
    head_dim = t.shape[0] // (3 * heads)
    rest = t.shape[1:]
    return t.reshape(heads, 3, head_dim, *rest).transpose(0, 1).reshape(3 * heads * head_dim, *rest)


def _qkv_from_hf(t: torch.Tensor, *, heads: int) -> torch.Tensor:
    """[q (all heads) | k | v] rows -> [heads, (q, k, v), hd] rows."""
    head_dim = t.shape[0] // (3 * heads)
    rest = t.shape[1:]
    return t.reshape(3, heads, head_dim, *rest).transpose(0, 1).reshape(3 * heads * head_dim, *rest)


def state_to_hf(full: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict (fp32, contiguous) of our whole unsharded model `full`."""
    heads, vocab = model["num_attention_heads"], model["vocab_size"]
    sd = {"transformer.wte.weight": full["wte.weight"][:vocab], "transformer.wpe.weight": full["wpe.weight"],
          "transformer.ln_f.weight": full["ln_f.weight"], "transformer.ln_f.bias": full["ln_f.bias"]}
    if "lm_head.weight" in full:
        sd["lm_head.weight"] = full["lm_head.weight"][:vocab]
    for i in range(model["num_layers"]):
        ours, theirs = f"h.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            for p in ("weight", "bias"):
                sd[f"{theirs}{ln}.{p}"] = full[f"{ours}{ln}.{p}"]
        sd[f"{theirs}attn.c_attn.weight"] = _qkv_to_hf(full[f"{ours}attn.qkv.weight"], heads=heads).t()
        sd[f"{theirs}attn.c_attn.bias"] = _qkv_to_hf(full[f"{ours}attn.qkv.bias"], heads=heads)
        for src, dst in _LINEARS:
            sd[f"{theirs}{dst}.weight"] = full[f"{ours}{src}.weight"].t()
            sd[f"{theirs}{dst}.bias"] = full[f"{ours}{src}.bias"]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sd.items()}


def state_from_hf(hf: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our whole unsharded model (fp32, vocabulary not padded) from GPT2LMHeadModel's state dict; CheckpointError
    naming a missing or unexpected weight."""
    # Folders of GPT2Model (and the original gpt2 upload) have no `transformer.` prefix.
    named = {k.removeprefix("transformer."): v for k, v in hf.items() if not k.endswith(_BUFFERS)}
    heads, h = model["num_attention_heads"], model["hidden_size"]
    f = model.get("ffn_hidden_size") or 4 * h
    used: set[str] = set()

    def take(name: str, *shape: int) -> torch.Tensor:
        shown = name if name == "lm_head.weight" else f"transformer.{name}"
        if name not in named:
            raise CheckpointError(f"the weights have no {shown} (a GPT2LMHeadModel with {model['num_layers']} layers "
                                  "has one); the files are incomplete or of another model")
        if tuple(named[name].shape) != shape:
            raise CheckpointError(f"{shown} is {tuple(named[name].shape)}, but config.json makes it {shape}; "
                                  "config.json does not match the weights")
        used.add(name)
        return named[name].detach().to(torch.float32)

    full = {"wte.weight": take("wte.weight", model["vocab_size"], h),
            "wpe.weight": take("wpe.weight", model["max_position_embeddings"], h)}
    sizes = {"attn.c_proj": (h, h), "mlp.c_fc": (h, f), "mlp.c_proj": (f, h)}  # Conv1D: [in, out]
    for i in range(model["num_layers"]):
        theirs, ours = f"h.{i}.", f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            for p in ("weight", "bias"):
                full[f"{ours}{ln}.{p}"] = take(f"{theirs}{ln}.{p}", h)
        full[f"{ours}attn.qkv.weight"] = _qkv_from_hf(take(f"{theirs}attn.c_attn.weight", h, 3 * h).t(), heads=heads)
        full[f"{ours}attn.qkv.bias"] = _qkv_from_hf(take(f"{theirs}attn.c_attn.bias", 3 * h), heads=heads)
        for dst, src in _LINEARS:
            full[f"{ours}{dst}.weight"] = take(f"{theirs}{src}.weight", *sizes[src]).t()
            full[f"{ours}{dst}.bias"] = take(f"{theirs}{src}.bias", sizes[src][1])
    full["ln_f.weight"], full["ln_f.bias"] = take("ln_f.weight", h), take("ln_f.bias", h)
    if not model.get("tie_embeddings", True):
        full["lm_head.weight"] = take("lm_head.weight", model["vocab_size"], h)
    elif "lm_head.weight" in named:  # a tied head saved anyway (pytorch_model.bin does): the same table
        used.add("lm_head.weight")
    extra = sorted(set(named) - used)
    if extra:
        raise CheckpointError(f"the weights hold {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}, which a "
                              f"GPT2LMHeadModel with {model['num_layers']} layers does not have; config.json does not "
                              "match the weights")
    return {k: v.contiguous() for k, v in full.items()}
